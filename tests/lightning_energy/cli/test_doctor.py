"""``lightning-energy doctor``: one OK/WARN/FAIL line per check, each failure with its fix."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_energy.cli import main
from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.device.lease import LEASE_DIR_ENV
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, a100, make_module
from tests.lightning_energy.processes import free_port

SECRET = "s3cret-token-never-printed"


@pytest.fixture(autouse=True)
def _environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))


def _install(monkeypatch: pytest.MonkeyPatch, module: FakeNVML) -> FakeNVML:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", module)
    return module


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """A machine without the NVIDIA driver (NVML's library cannot be loaded)."""
    module = make_module([])
    module.init_error = ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"]
    return _install(monkeypatch, module)


def _config(tmp_path: Path, **sections: Any) -> Path:
    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


def _lines(out: str) -> dict[str, str]:
    """``name -> "STATUS message"`` for the first line of each check name."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        status, _, rest = line.partition("  ")
        if status.strip() in ("OK", "WARN", "FAIL"):
            name, _, message = rest.strip().partition("  ")
            found.setdefault(name.strip(), f"{status.strip()} {message.strip()}")
    return found


def test_without_a_gpu_it_explains_the_simulated_fallback(
    no_gpu: FakeNVML, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    assert lines["nvml"].startswith("WARN not available")
    assert "simulated GPU" in lines["nvml"]
    assert "fix: install the NVIDIA driver" in out
    assert lines["config"] == "OK no configuration file: the defaults apply"
    assert lines["leases"].startswith("OK") and "is writable" in lines["leases"]


def test_nvml_backend_without_driver_fails(
    no_gpu: FakeNVML, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, device={"backend": "nvml"})
    assert main(["doctor", "--config", str(config)]) == 1
    assert _lines(capsys.readouterr().out)["nvml"].startswith("FAIL")


def test_simulated_backend_does_not_need_nvml(
    no_gpu: FakeNVML, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, device={"backend": "simulated"})
    assert main(["doctor", "--config", str(config)]) == 0
    assert "not needed" in _lines(capsys.readouterr().out)["nvml"]


def test_gpus_ranges_and_permission_checked_without_changes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, make_module([a100(0, limit_mw=350_000), a100(1)]))
    assert main(["doctor"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert lines["nvml"] == "OK NVML initialised; 2 GPU(s) visible"
    assert "power limit 350 W, range 100-400 W, default 400 W" in lines["gpu 0"]
    assert lines["gpu 1 perms"].startswith("OK may change the power limit")
    # the check sets each GPU's current limit back to itself (then restores it): nothing changes
    assert {call[1:] for call in fake.calls} == {
        (fake.devices[0].uuid, 350_000),
        (fake.devices[1].uuid, 400_000),
    }
    assert [d.limit_mw for d in fake.devices] == [350_000, 400_000]


def test_permission_check_leaves_a_gpu_of_a_live_job_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.device.nvml import nvml_gpus

    fake = _install(monkeypatch, make_module([a100(0)]))
    gpus = nvml_gpus()
    try:
        with GPUGuard(gpus, install_signal_handlers=False) as job:
            job.set_power_limit_w(150.0)  # a job profiling on this GPU
            before = list(fake.calls)
            assert main(["doctor"]) == 0
            assert fake.calls == before  # the doctor changed nothing under the job
            line = _lines(capsys.readouterr().out)["gpu 0 perms"]
            assert line.startswith("WARN") and f"pid {os.getpid()}" in line
            assert fake.devices[0].limit_mw == 150_000
    finally:
        for gpu in gpus:
            gpu.close()
    assert fake.devices[0].limit_mw == 400_000


def test_permission_check_goes_through_a_lease(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, make_module([a100(0, limit_mw=350_000)]))
    seen: list[list[str]] = []

    def set_limit(handle: Any, limit_mw: int) -> None:
        seen.append(sorted(p.name for p in (tmp_path / "leases").glob("*.json")))
        handle.limit_mw = limit_mw

    monkeypatch.setattr(fake, "nvmlDeviceSetPowerManagementLimit", set_limit)
    assert main(["doctor"]) == 0
    assert seen and all(names == [f"{fake.devices[0].uuid}.json"] for names in seen)
    assert list((tmp_path / "leases").glob("*.json")) == []  # released after the check
    assert fake.devices[0].limit_mw == 350_000


def test_missing_permission_fails_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    denied = {"nvmlDeviceSetPowerManagementLimit": ERROR_CODES["NVML_ERROR_NO_PERMISSION"]}
    _install(monkeypatch, make_module([a100(0, errors=denied)]))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["gpu 0 perms"].startswith("FAIL no permission")
    assert "CAP_SYS_ADMIN" in out and "--cap-add SYS_ADMIN" in out


def test_invalid_config_exits_2_naming_every_problem(
    no_gpu: FakeNVML, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, device={"backend": "cuda"}, power_limit={"eta": 2})
    assert main(["doctor", "--config", str(config)]) == 2
    out = capsys.readouterr().out
    assert _lines(out)["config"].startswith("FAIL 2 problems")
    assert "device.backend" in out and "'cuda'" in out and "power_limit" in out


@pytest.mark.wall_clock  # doctor reads the trace at today's date; any date passes the check
def test_config_from_the_environment_and_trace_provider(
    no_gpu: FakeNVML,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _config(tmp_path, carbon={"provider": "trace", "region": "FR"})
    monkeypatch.setenv(CONFIG_ENV_VAR, str(config))
    assert main(["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["config"]["status"] == "OK" and str(config) in checks["config"]["message"]
    assert checks["carbon"]["status"] == "OK"
    assert checks["carbon"]["message"].startswith("trace FR: ")
    assert "gCO2eq/kWh" in checks["carbon"]["message"]


class _Reject(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"error": "Invalid token"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def rejecting_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reject)
    thread = threading.Thread(target=server.serve_forever, name="doctor-test-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_rejected_token_fails_without_printing_it(
    no_gpu: FakeNVML,
    rejecting_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DOCTOR_EM_TOKEN", SECRET)
    carbon = {
        "provider": "electricitymaps",
        "region": "DE",
        "token_env": "DOCTOR_EM_TOKEN",
        "base_url": rejecting_server,
    }
    config = _config(tmp_path, carbon=carbon)
    assert main(["doctor", "--config", str(config), "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["carbon"].startswith(
        "FAIL region DE: electricitymaps: the token was rejected"
    )
    assert "Invalid token" in _lines(out)["carbon"]
    assert SECRET not in out


def test_unreachable_provider_fails(
    no_gpu: FakeNVML,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()  # a port nobody listens on
    monkeypatch.setenv("DOCTOR_EM_TOKEN", SECRET)
    carbon = {
        "provider": "electricitymaps",
        "region": "DE",
        "token_env": "DOCTOR_EM_TOKEN",
        "base_url": f"http://127.0.0.1:{port}",
    }
    assert main(["doctor", "--config", str(_config(tmp_path, carbon=carbon))]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["carbon"].startswith("FAIL region DE: unreachable")
    assert SECRET not in out


def test_unwritable_lease_directory_fails(
    no_gpu: FakeNVML,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(LEASE_DIR_ENV, str(blocker / "leases"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["leases"].startswith("FAIL")
    assert f"or set {LEASE_DIR_ENV}" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--timeout", "0"]) == 2
    assert "--timeout: '0' is not allowed; use a number > 0" in capsys.readouterr().err
    assert main(["doctor", "--bogus"]) == 2


def test_unsafe_lease_directory_fails_and_refused_files_are_listed(
    no_gpu: FakeNVML, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lease_dir = tmp_path / "leases"
    lease_dir.mkdir()
    lease_dir.chmod(0o777)  # anyone may replace anyone's lease
    assert main(["doctor"]) == 1
    line = _lines(capsys.readouterr().out)["leases"]
    assert line.startswith("FAIL unsafe lease directory") and "sticky" in line
    lease_dir.chmod(0o1777)
    os.mkfifo(lease_dir / "GPU-planted.json")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "WARN  leases  1 file(s) are refused" in out and "FIFO" in out


def test_mixed_models_that_cannot_be_numbered_are_a_failed_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without CUDA, GPUs of different models cannot be numbered as CUDA numbers them under
    its fastest-first order: doctor says so and how to fix it, without a traceback."""
    from tests.lightning_energy.device.fake_cuda import FakeCuda

    fake = _install(monkeypatch, make_module([a100(0, name="NVIDIA A40"), a100(1)]))
    FakeCuda(fake.devices, available=False).install(monkeypatch)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    assert "FAIL" in _lines(out)["nvml"] and "PCI_BUS_ID" in out
