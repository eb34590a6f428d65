"""The zeusd backend: chosen by ``auto`` for a process that may not change settings
itself, changes through the daemon and reads through NVML, finds the daemon's index of each
GPU safely, and keeps every promise of the guard (leases, restore, observe-only) when the
token lacks the scope, the daemon is down, dies mid-run or answers too late."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.device import NVMLGPU, ZeusdGPU, nvml_gpus, open_devices
from lightning_energy.device.guard import GPUGuard, recover
from lightning_energy.device.lease import LeaseStore
from lightning_energy.device.zeusd import daemon_from_env
from lightning_energy.device.zeusd_client import ZeusdAddress, ZeusdClient
from lightning_energy.errors import (
    ConfigError,
    DaemonUnreachableError,
    DriverError,
    GPULostError,
    GPUNotFoundError,
    NoPermissionError,
)
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeDevice, a100, make_module
from tests.lightning_energy.device.fake_zeusd import (
    SIGNING_KEY,
    FakeZeusd,
    Node,
    issue_token,
    zeusd_node,
)

PRE_JOB_MW = 400_000


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0), a100(1)]) as n:
        yield n


def guard_of(gpus: list[NVMLGPU], tmp_path: Path, **kwargs: object) -> GPUGuard:
    return GPUGuard(gpus, lease_dir=tmp_path / "leases", install_signal_handlers=False, **kwargs)  # type: ignore[arg-type]


def lease_texts(tmp_path: Path) -> list[str]:
    return [p.read_text() for p in sorted((tmp_path / "leases").glob("*.json"))]


# ------------------------------------------------------------------ choosing the backend
def test_auto_changes_settings_through_zeusd_for_an_unprivileged_process(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_energy.device"):
        devices = open_devices()
    with devices:
        assert devices.backend == "zeusd" and all(isinstance(g, ZeusdGPU) for g in devices.gpus)
        with guard_of(list(devices.gpus), tmp_path) as guard:  # type: ignore[arg-type]
            assert guard.set_power_limit_w(250.0) == 250.0
            assert [d.limit_mw for d in node.nvml.devices] == [250_000, 250_000]
            leases = lease_texts(tmp_path)
        assert [d.limit_mw for d in node.nvml.devices] == [PRE_JOB_MW, PRE_JOB_MW]
    assert (tmp_path / "leases").is_dir() and lease_texts(tmp_path) == []
    (line,) = [r for r in caplog.records if "zeusd" in r.getMessage()]
    assert (
        line.levelno == logging.INFO and node.daemon.address.split(":", 1)[1] in line.getMessage()
    )
    for text in leases:  # the daemon's address, never the token
        lease = json.loads(text)
        assert (lease["backend"], lease["zeusd_address"]) == ("zeusd", node.daemon.address)
        assert node.token is not None and node.token not in text
    assert {path for path, _ in node.daemon.writes()} == {"/gpu/set_power_limit"}


@pytest.mark.parametrize(("privileged", "configure"), [(True, True), (False, False)])
def test_auto_keeps_nvml_when_root_or_when_no_zeusd_is_configured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, privileged: bool, configure: bool
) -> None:
    with (
        zeusd_node(
            monkeypatch,
            tmp_path / "zeusd.sock",
            [a100(0)],
            privileged=privileged,
            configure=configure,
        ) as n,
        open_devices() as devices,
    ):
        assert devices.backend == "nvml" and type(devices.gpus[0]) is NVMLGPU
        with guard_of(list(devices.gpus), tmp_path) as guard:  # type: ignore[arg-type]
            guard.set_power_limit_w(300.0)
            assert guard.observe_only is not privileged
    assert n.daemon.writes() == []


def test_backend_zeusd_without_variables_uses_zeusds_default_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lightning_energy.device import zeusd_client as client_module  # the module

    old = tmp_path / "var-run-zeusd.sock"
    monkeypatch.setattr(client_module, "DEFAULT_SOCKET_PATHS", (str(tmp_path / "none"), str(old)))
    with (
        zeusd_node(monkeypatch, old, [a100(0)], scopes=None, configure=False) as n,
        open_devices("zeusd") as devices,
    ):
        gpu = devices.gpus[0]
        assert isinstance(gpu, ZeusdGPU) and str(gpu.daemon.address) == f"unix:{old}"
        with guard_of([gpu], tmp_path) as guard:
            guard.set_power_limit_w(300.0)
            assert n.nvml.devices[0].limit_mw == 300_000
    assert n.nvml.devices[0].limit_mw == PRE_JOB_MW


def test_a_daemon_that_is_not_there_makes_the_job_observe(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node.daemon.stop()
    with open_devices("zeusd") as devices:
        gpus: list[NVMLGPU] = list(devices.gpus)  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING), guard_of(gpus, tmp_path) as guard:
            assert guard.set_power_limit_w(250.0) == 400.0
            assert guard.observe_only and "cannot be reached" in (guard.observe_only_reason or "")
            assert gpus[0].energy_j() == 123.456  # still measured, through NVML
        with pytest.raises(DaemonUnreachableError), guard_of(gpus, tmp_path, strict=True) as strict:
            strict.set_power_limit_w(250.0)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert lease_texts(tmp_path) == [] and node.nvml.calls == []


def test_the_configuration_allows_backend_zeusd() -> None:
    assert EnergyConfig.from_mapping({"device": {"backend": "zeusd"}}).device.backend == "zeusd"
    with pytest.raises(ConfigError, match="allowed: auto, nvml, zeusd, simulated"):
        EnergyConfig.from_mapping({"device": {"backend": "cuda"}})


def test_the_gpu_and_its_client_never_show_the_token(node: Node) -> None:
    assert node.token is not None
    with open_devices("zeusd") as devices:
        gpu = devices.gpus[0]
        assert isinstance(gpu, ZeusdGPU)
        for text in (repr(gpu), repr(gpu.daemon), str(gpu.lease_source())):
            assert node.token not in text
        assert "token=set" in repr(gpu.daemon)


# ------------------------------------------------------------------ which of zeusd's GPUs
def _container_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, schema: str
) -> tuple[list[FakeDevice], FakeZeusd]:
    """Four GPUs on the node; the job's container sees the last two (NVML numbers them
    0 and 1 here, the daemon on the host 2 and 3)."""
    devices = [a100(i, pci_bus=0x40 + i) for i in range(4)]
    host = make_module(devices)
    job = make_module(devices[2:])
    job.require_root = True
    monkeypatch.setitem(sys.modules, "pynvml", job)
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    daemon = FakeZeusd(host, socket_path=tmp_path / "zeusd.sock", schema=schema).start()
    return devices, daemon


def test_the_daemons_gpu_is_found_by_pci_address_in_a_container(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    devices, daemon = _container_node(monkeypatch, tmp_path, "master")
    client = ZeusdClient(ZeusdAddress.parse(daemon.address))
    try:
        gpus = nvml_gpus([0], factory=functools.partial(ZeusdGPU, daemon=client))
        assert gpus[0].daemon_index() == 2  # type: ignore[attr-defined]
        with guard_of(gpus, tmp_path) as guard:
            guard.set_power_limit_w(200.0)
            assert [d.limit_mw for d in devices] == [PRE_JOB_MW] * 2 + [200_000, PRE_JOB_MW]
        gpus[0].close()
    finally:
        daemon.stop()
    assert [d.limit_mw for d in devices] == [PRE_JOB_MW] * 4


def test_without_pci_addresses_a_container_is_refused_and_no_gpu_changes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    devices, daemon = _container_node(monkeypatch, tmp_path, "0.5")
    client = ZeusdClient(ZeusdAddress.parse(daemon.address))
    try:
        gpus = nvml_gpus([0], factory=functools.partial(ZeusdGPU, daemon=client))
        with pytest.raises(GPUNotFoundError, match=r"lists 4 GPU.*NVML shows 2"):
            gpus[0].set_power_limit_w(200.0)
        with guard_of(gpus, tmp_path) as guard:
            guard.set_power_limit_w(200.0)
            assert guard.observe_only and "PCI addresses" in (guard.observe_only_reason or "")
        gpus[0].close()
    finally:
        daemon.stop()
    assert daemon.writes() == [] and [d.limit_mw for d in devices] == [PRE_JOB_MW] * 4


def test_another_model_at_the_same_index_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host = make_module([a100(0, name="NVIDIA H100 80GB HBM3")])
    job = make_module([a100(0)])
    monkeypatch.setitem(sys.modules, "pynvml", job)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with FakeZeusd(host, socket_path=tmp_path / "z.sock", schema="0.5") as daemon:
        client = ZeusdClient(ZeusdAddress.parse(daemon.address))
        (gpu,) = nvml_gpus(factory=functools.partial(ZeusdGPU, daemon=client))
        with pytest.raises(GPUNotFoundError, match="has a NVIDIA H100 80GB HBM3 at index 0"):
            gpu.set_power_limit_w(200.0)
        gpu.close()
    assert host.calls == []


# ------------------------------------------------------------------ reads
def test_reads_fall_back_to_zeusd_only_where_nvml_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unknown = ERROR_CODES["NVML_ERROR_UNKNOWN"]
    host = make_module([a100(0, energy_mj=999_000, power_mw=111_000)])
    job = make_module(
        [
            a100(
                0,
                errors={
                    "nvmlDeviceGetTotalEnergyConsumption": unknown,
                    "nvmlDeviceGetPowerUsage": unknown,
                },
            )
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", job)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with FakeZeusd(host, socket_path=tmp_path / "z.sock") as daemon:
        client = ZeusdClient(ZeusdAddress.parse(daemon.address))
        (gpu,) = nvml_gpus(factory=functools.partial(ZeusdGPU, daemon=client))
        try:
            with caplog.at_level(logging.INFO, logger="lightning_energy.device.zeusd"):
                assert gpu.energy_j() == gpu.energy_j() == 999.0  # the daemon's counter
                assert gpu.power_w() == 111.0
            assert gpu.power_limit_w() == 400.0  # NVML's, which works
            said = [r.getMessage() for r in caplog.records]  # once per reading
            assert len(said) == 2 and all("NVML_ERROR_UNKNOWN" in line for line in said)
            assert "its energy counter" in said[0] and "its power (" in said[1]
            assert all(f"read through zeusd at {daemon.address}" in line for line in said)
            daemon.stop()  # both fail: NVML's error, which says more
            with pytest.raises(DriverError, match="NVML: NVML_ERROR_UNKNOWN"):
                gpu.energy_j()
            job.devices[0].lost = True
            daemon.start()
            with pytest.raises(GPULostError):  # a lost GPU is never read elsewhere
                gpu.energy_j()
        finally:
            gpu.close()
            daemon.stop()


# ------------------------------------------------------------------ the guard through zeusd
def test_a_token_without_gpu_control_observes_and_strict_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with (
        zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], scopes=["gpu-read"]) as n,
        open_devices("zeusd") as devices,
    ):
        gpus: list[NVMLGPU] = list(devices.gpus)  # type: ignore[arg-type]
        with guard_of(gpus, tmp_path) as guard:
            guard.set_power_limit_w(250.0)
            reason = guard.observe_only_reason or ""
        assert "lacks required scope 'gpu-control'" in reason
        with (
            pytest.raises(NoPermissionError, match="gpu-control"),
            guard_of(gpus, tmp_path, strict=True) as strict,
        ):
            strict.set_power_limit_w(250.0)
    assert n.nvml.calls == [] and lease_texts(tmp_path) == []


def test_a_daemon_dying_mid_run_observes_and_the_gpu_is_put_back_once_it_returns(
    node: Node, tmp_path: Path
) -> None:
    with open_devices("zeusd") as devices:
        gpus: list[NVMLGPU] = list(devices.gpus)  # type: ignore[arg-type]
        with guard_of(gpus, tmp_path) as guard:
            guard.set_power_limit_w(300.0)
            node.daemon.stop()
            guard.set_power_limit_w(250.0)
            assert guard.observe_only and "cannot be reached" in (guard.observe_only_reason or "")
            assert [d.limit_mw for d in node.nvml.devices] == [300_000] * 2  # not lost
            assert len(lease_texts(tmp_path)) == 2  # kept: the GPUs are still changed
            node.daemon.start()
    assert [d.limit_mw for d in node.nvml.devices] == [PRE_JOB_MW] * 2
    assert lease_texts(tmp_path) == []


def test_a_daemon_still_down_at_the_end_leaves_leases_that_recover_restores(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_devices("zeusd") as devices:
        gpus: list[NVMLGPU] = list(devices.gpus)  # type: ignore[arg-type]
        with guard_of(gpus, tmp_path) as guard:
            guard.set_power_limit_w(300.0)
            node.daemon.stop()
    assert len(lease_texts(tmp_path)) == 2
    assert [d.limit_mw for d in node.nvml.devices] == [300_000] * 2
    assert "lightning-energy recover" in caplog.text
    # The job is gone (here: the machine rebooted since, as far as the leases say).
    store = LeaseStore(tmp_path / "leases")
    for gpu in node.nvml.devices:
        lease = store.read(gpu.uuid)
        assert lease is not None
        owner = dataclasses.replace(lease.owner, boot_id="an-earlier-boot")
        store.write(dataclasses.replace(lease, owner=owner))
    node.daemon.start()
    results = recover(tmp_path / "leases")
    assert [r.status for r in results] == ["restored", "restored"]
    assert all(f"through zeusd at {node.daemon.address}" in r.message for r in results)
    assert [d.limit_mw for d in node.nvml.devices] == [PRE_JOB_MW] * 2


def test_a_change_answered_too_late_is_still_restored(node: Node, tmp_path: Path) -> None:
    """A lock the daemon applied but answered after the client gave up: the guard cannot
    know, so it restores as if it had been applied."""
    assert node.token is not None
    client = ZeusdClient(ZeusdAddress.parse(node.daemon.address), token=node.token, timeout_s=0.2)
    gpus = nvml_gpus([0], factory=functools.partial(ZeusdGPU, daemon=client))
    try:
        # zeusd's index of the GPU is asked before the daemon slows down.
        assert gpus[0].daemon_index() == 0  # type: ignore[attr-defined]
        with guard_of(gpus, tmp_path) as guard:
            with node.daemon.hold():
                assert guard.lock_clocks_mhz(1005, 1005) is None
            assert guard.observe_only and "within 0.2 s" in (guard.observe_only_reason or "")
    finally:
        gpus[0].close()
    assert node.nvml.devices[0].locked is None
    assert lease_texts(tmp_path) == []


def test_the_daemon_of_the_environment(node: Node) -> None:
    assert str(daemon_from_env().address) == node.daemon.address
    token = issue_token(SIGNING_KEY, "carol", ["gpu-read"])
    assert daemon_from_env({"ZEUSD_HOST_PORT": "127.0.0.1:4938", "ZEUSD_TOKEN": token}).has_token
