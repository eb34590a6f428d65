"""A training process that changes its GPUs through zeusd, ended by SIGTERM (it restores
through the daemon) or SIGKILL (its lease stays, and ``lightning-energy recover``, run as
the same ordinary user, restores through the daemon)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_energy.cli import main
from tests.lightning_energy.device.fake_pynvml import a100
from tests.lightning_energy.device.fake_zeusd import Node, zeusd_node
from tests.lightning_energy.processes import ROOT

PRE_JOB_MW = 400_000
_FIELDS = (
    "name",
    "uuid",
    "pci_bus",
    "limit_mw",
    "default_limit_mw",
    "min_limit_mw",
    "max_limit_mw",
)
_HANG_GUARD_S = 120.0


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0, pci_bus=0x41)]) as n:
        yield n


@pytest.fixture
def job(node: Node, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The training process, once it has changed its GPU through the daemon."""
    devices = [
        {k: v for k, v in dataclasses.asdict(d).items() if k in _FIELDS} for d in node.nvml.devices
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.lightning_energy.device.zeusd_child",
            str(tmp_path / "leases"),
            json.dumps(devices),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready:
            pytest.fail(f"the job exited early: {proc.communicate()[1]}")
        assert json.loads(ready)["observe_only"] is False
        deadline = time.monotonic() + _HANG_GUARD_S
        while node.nvml.devices[0].limit_mw == PRE_JOB_MW:  # until it profiles a limit
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_sigterm_restores_through_the_daemon(
    node: Node, job: subprocess.Popen[str], tmp_path: Path
) -> None:
    assert node.nvml.devices[0].limit_mw in (300_000, 250_000)
    assert list((tmp_path / "leases").glob("*.json"))
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate()
    assert job.returncode == -signal.SIGTERM, err
    assert node.nvml.devices[0].limit_mw == PRE_JOB_MW
    assert list((tmp_path / "leases").glob("*.json")) == []
    paths = {path for path, _ in node.daemon.writes()}
    assert paths == {"/gpu/set_power_limit"}  # every change went through zeusd


def test_sigkill_then_recover_restores_through_the_daemon(
    node: Node, job: subprocess.Popen[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job.send_signal(signal.SIGKILL)
    job.communicate()
    left = node.nvml.devices[0].limit_mw
    assert left != PRE_JOB_MW
    (lease,) = (tmp_path / "leases").glob("*.json")
    recorded = json.loads(lease.read_text())
    assert recorded["zeusd_address"] == node.daemon.address
    assert node.token is not None and node.token not in lease.read_text()

    assert main(["recover", "--lease-dir", str(tmp_path / "leases")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("restored") and f"through zeusd at {node.daemon.address}" in out
    assert node.nvml.devices[0].limit_mw == PRE_JOB_MW
    assert list((tmp_path / "leases").glob("*.json")) == []
