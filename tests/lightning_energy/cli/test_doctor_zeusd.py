"""``lightning-energy doctor`` with zeusd: whether the daemon answers, its ``/discover``
schema, API groups and authentication, whether the token has the scopes a job needs, and the
permission check made through the daemon; the token is never printed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_energy.cli import main
from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.device.lease import LEASE_DIR_ENV
from tests.lightning_energy.cli.test_doctor import _lines
from tests.lightning_energy.device.fake_pynvml import a100
from tests.lightning_energy.device.fake_zeusd import FakeZeusd, Node, zeusd_node

SCHEMA_WORDS = {
    "0.4": "zeusd 0.4 (GPU indices only)",
    "0.5": "zeusd 0.5.0 (GPU names)",
    "master": "zeusd after 0.5.0 (GPU names and PCI addresses)",
}


@pytest.fixture(autouse=True)
def _environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)]) as n:
        yield n


def _fix(out: str, name: str) -> str:
    """The fix printed under the first line of check ``name`` ("" when none)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line[6:].startswith(name + "  ") and i + 1 < len(lines):
            following = lines[i + 1]
            return following.split("fix: ", 1)[1] if following.startswith(" ") else ""
    return ""


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("schema", sorted(SCHEMA_WORDS))
def test_it_names_the_daemon_its_schema_groups_and_the_tokens_scopes(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    schema: str,
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], schema=schema) as n:
        code, out = _doctor(capsys)
        lines = _lines(out)
        assert code == 0, out
        assert lines["zeusd"].startswith(f"OK {n.daemon.address}: {SCHEMA_WORDS[schema]}")
        assert "1 GPU(s)" in lines["zeusd"]
        assert "API groups gpu-control, gpu-read, cpu-read" in lines["zeusd"]
        assert "a token is required" in lines["zeusd"]
        token_line = lines["zeusd token"]
        assert token_line.startswith("OK") and "alice" in token_line
        assert "gpu-control" in token_line and "never expires" in token_line
        # The permission check went through the daemon (the limit set back to itself).
        assert lines["gpu 0 perms"].startswith("OK")
        probe = {"gpu_ids": "0", "power_limit_mw": "400000", "block": "true"}
        writes = n.daemon.writes()  # the probe, then the guard's restore
        assert writes and all(w == ("/gpu/set_power_limit", probe) for w in writes)
        assert n.nvml.calls and all(
            c[:3] == ("set_power_limit", n.nvml.devices[0].uuid, 400_000) for c in n.nvml.calls
        )
        assert n.nvml.devices[0].limit_mw == 400_000
        assert n.token is not None and n.token not in out


def test_a_token_without_gpu_control_fails_with_the_scope_to_ask_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], scopes=["gpu-read"]) as n:
        code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 1
    assert lines["zeusd"].startswith("OK")
    assert lines["zeusd token"].startswith("FAIL") and "lacks the scope gpu-control" in out
    assert _fix(out, "zeusd token").startswith("ask the administrator for a token with the scope")
    assert lines["gpu 0 perms"].startswith("FAIL")
    assert "ZEUSD_TOKEN" in _fix(out, "gpu 0 perms")  # zeusd's fix, not root's
    assert n.nvml.devices[0].limit_mw == 400_000
    assert n.token is not None and n.token not in out


def test_a_missing_token_fails_and_says_how_to_get_one(
    node: Node, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ZEUSD_TOKEN")
    code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 1
    assert lines["zeusd token"].startswith("FAIL") and "ZEUSD_TOKEN is not set" in out
    assert "zeusd token issue" in _fix(out, "zeusd token")


def test_a_rejected_token_fails_without_being_printed(
    node: Node, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.token is not None
    forged = node.token[:-4] + ("AAAA" if not node.token.endswith("AAAA") else "BBBB")
    monkeypatch.setenv("ZEUSD_TOKEN", forged)
    code, out = _doctor(capsys, "--json")
    checks = {c["name"]: c for c in json.loads(out)}
    assert code == 1
    assert checks["zeusd token"]["status"] == "FAIL" and "401" in checks["zeusd token"]["message"]
    assert forged not in out and node.token not in out


def test_a_daemon_requiring_no_token_needs_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], scopes=None):
        code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 0, out
    assert "no token is required" in lines["zeusd"]
    assert lines["zeusd token"] == "OK the daemon requires no token"


def test_a_daemon_that_does_not_answer_fails_with_the_fix(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.daemon.stop()
    code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 1
    assert lines["zeusd"].startswith("FAIL") and "cannot be reached" in lines["zeusd"]
    assert "zeusd token" not in lines
    assert lines["gpu 0 perms"].startswith("FAIL")


def test_a_daemon_without_gpu_control_fails(
    node: Node,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeZeusd(
        node.nvml, socket_path=tmp_path / "read-only.sock", enable=["gpu-read"]
    ) as daemon:
        monkeypatch.setenv("ZEUSD_SOCK_PATH", str(daemon.socket_path))
        monkeypatch.delenv("ZEUSD_TOKEN")
        code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 1
    assert lines["zeusd"].startswith("FAIL") and "API groups gpu-read" in lines["zeusd"]
    assert "--enable gpu-control" in _fix(out, "zeusd")
    assert lines["gpu 0 perms"].startswith("WARN")  # 404: not supported, observe-only


def test_unusable_zeusd_variables_fail_naming_the_variable(
    node: Node, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ZEUSD_SOCK_PATH")
    monkeypatch.setenv("ZEUSD_HOST_PORT", "no-port-here")
    code, out = _doctor(capsys)
    lines = _lines(out)
    assert code == 1
    assert lines["zeusd"].startswith("FAIL ZEUSD_HOST_PORT")


def test_root_changes_settings_itself_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], privileged=True) as n:
        code, out = _doctor(capsys)
        assert n.daemon.requests == []  # not asked: no token sent anywhere
    lines = _lines(out)
    assert code == 0, out
    assert lines["zeusd"].startswith("OK") and "changes GPU settings itself" in lines["zeusd"]
