"""``recover`` of leases a zeusd job left: an ordinary user restores through zeusd what
their own lease records, another user's lease is restored only through the caller's own
daemon (never an address that user wrote) and may only undo a lowering, and root restores
through NVML, sending no token anywhere."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.cli import main
from lightning_energy.device.guard import recover
from lightning_energy.device.lease import Lease, LeaseStore, ProcessIdentity
from lightning_energy.errors import DeviceError
from tests.lightning_energy.device.fake_pynvml import a100
from tests.lightning_energy.device.fake_zeusd import FakeZeusd, Node, zeusd_node

LEFT_MW = 250_000  # what the killed job left


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)]) as n:
        n.nvml.devices[0].limit_mw = LEFT_MW
        yield n


@pytest.fixture
def trap(node: Node, tmp_path: Path) -> Iterator[FakeZeusd]:
    """A daemon another user runs (it could collect tokens, or lie)."""
    with FakeZeusd(node.nvml, socket_path=tmp_path / "trap.sock") as fake:
        yield fake


def write_lease(tmp_path: Path, node: Node, **overrides: Any) -> Path:
    device = node.nvml.devices[0]
    fields: dict[str, Any] = {
        "gpu_uuid": device.uuid,
        "gpu_index": 0,
        "gpu_name": device.name,
        # From before the last reboot: stale wherever it is read.
        "owner": dataclasses.replace(ProcessIdentity.current(), boot_id="an-earlier-boot"),
        "power_limit_w": 400.0,
        "locked_clocks_mhz": None,
        "power_limit_changed": True,
        "backend": "zeusd",
        "zeusd_address": node.daemon.address,
    }
    fields.update(overrides)
    store = LeaseStore(tmp_path / "leases")
    store.write(Lease(**fields))
    return store.path_for(device.uuid)


def test_an_ordinary_user_restores_their_lease_through_the_daemon_it_records(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZEUSD_SOCK_PATH")  # only the token: the lease says where
    path = write_lease(tmp_path, node)
    (result,) = recover(tmp_path / "leases")
    assert result.status == "restored", result.message
    assert f"through zeusd at {node.daemon.address}" in result.message
    assert node.nvml.devices[0].limit_mw == 400_000 and not path.exists()
    assert [p for p, _ in node.daemon.writes()] == ["/gpu/set_power_limit"]


def test_another_users_lease_goes_through_the_callers_daemon_never_the_one_it_names(
    node: Node, trap: FakeZeusd, tmp_path: Path
) -> None:
    write_lease(tmp_path, node, zeusd_address=trap.address)
    (result,) = recover(tmp_path / "leases", trusted_uids={4242})  # the file is not ours
    assert result.status == "restored", result.message
    assert f"through zeusd at {node.daemon.address}" in result.message
    assert node.nvml.devices[0].limit_mw == 400_000  # a lowering undone, up to the default
    assert trap.requests == []  # not even asked: the caller's token never went there


def test_another_users_lease_asking_for_less_is_refused(
    node: Node, trap: FakeZeusd, tmp_path: Path
) -> None:
    path = write_lease(tmp_path, node, power_limit_w=150.0, zeusd_address=trap.address)
    (result,) = recover(tmp_path / "leases", trusted_uids={4242})
    assert result.status == "refused" and "lower than" in result.message
    assert node.nvml.devices[0].limit_mw == LEFT_MW and path.exists()
    assert node.daemon.writes() == [] and trap.requests == []


def test_another_users_lease_without_a_daemon_of_the_callers_fails_and_is_kept(
    node: Node, trap: FakeZeusd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZEUSD_SOCK_PATH")
    path = write_lease(tmp_path, node, zeusd_address=trap.address)
    (result,) = recover(tmp_path / "leases", trusted_uids={4242})
    assert result.status == "failed" and "NO_PERMISSION" in result.message
    assert path.exists() and trap.requests == []


def test_root_restores_through_nvml_and_sends_no_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], privileged=True) as root:
        root.nvml.devices[0].limit_mw = LEFT_MW
        write_lease(tmp_path, root)
        (result,) = recover(tmp_path / "leases")
        assert result.status == "restored" and "zeusd" not in result.message
        assert root.nvml.devices[0].limit_mw == 400_000
        assert root.daemon.requests == []


def test_the_recover_command_says_how_and_never_shows_the_token(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_lease(tmp_path, node)
    assert main(["recover", "--lease-dir", str(tmp_path / "leases"), "--json"]) == 0
    out = capsys.readouterr().out
    (result,) = json.loads(out)["results"]
    assert result["status"] == "restored" and "through zeusd at" in result["message"]
    assert node.token is not None and node.token not in out


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"zeusd_address": None}, "goes with backend zeusd"),
        ({"backend": "nvml"}, "goes with backend zeusd"),
        ({"zeusd_address": "http://evil:80"}, "is not unix:<path> or tcp:<host>:<port>"),
        ({"zeusd_address": "unix:relative/z.sock"}, "absolute socket path"),
    ],
)
def test_a_lease_with_a_bad_daemon_address_is_malformed(
    node: Node, tmp_path: Path, changes: dict[str, Any], why: str
) -> None:
    path = write_lease(tmp_path, node)
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceError, match=why):
        LeaseStore(tmp_path / "leases").read(node.nvml.devices[0].uuid)


def test_a_lease_of_a_version_without_zeusd_still_reads(node: Node, tmp_path: Path) -> None:
    path = write_lease(tmp_path, node, backend="nvml", zeusd_address=None)
    data = json.loads(path.read_text())
    del data["zeusd_address"]
    path.write_text(json.dumps(data))
    lease = LeaseStore(tmp_path / "leases").read(node.nvml.devices[0].uuid)
    assert lease is not None and (lease.backend, lease.zeusd_address) == ("nvml", None)


def test_a_clock_lock_left_behind_is_released_through_the_daemon(
    node: Node, tmp_path: Path
) -> None:
    device = node.nvml.devices[0]
    device.locked = (1005, 1005)  # what the killed job left
    path = write_lease(tmp_path, node, power_limit_changed=False, clocks_changed=True)
    (result,) = recover(tmp_path / "leases")
    assert result.status == "restored", result.message
    assert device.locked is None and not path.exists()
    assert [p for p, _ in node.daemon.writes()] == ["/gpu/reset_gpu_locked_clocks"]
