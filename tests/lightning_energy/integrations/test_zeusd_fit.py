"""A whole Lightning fit whose GPU settings change through zeusd: simulated training on the
CPU, a fake zeusd changing the fake NVML GPUs; the profile's limits go through the
daemon, the GPU is put back at the end, and the token appears nowhere (logs, report,
lease, reprs). A token without ``gpu-control`` makes the fit observe with one warning, or
fail in strict mode."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_energy.errors import NoPermissionError
from lightning_energy.integrations.lightning import EnergyCallback
from tests.lightning_energy.device.fake_pynvml import a100
from tests.lightning_energy.device.fake_zeusd import Node, zeusd_node
from tests.lightning_energy.integrations._models import make_loader, module_class

PRE_JOB_MW = 400_000


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Node]:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0), a100(1)]) as n:
        yield n


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "device": {"backend": "zeusd", "lease_dir": str(tmp_path / "leases")},
        "power_limit": {"power_limits_w": [300, 250], "warmup_steps": 0, "settle_steps": 0},
        "report": str(tmp_path / "report.json"),
        **extra,
    }


class LeaseReader(pl.Callback):
    """Keeps the text of the lease files as they are mid-fit."""

    def __init__(self, lease_dir: Path) -> None:
        self.lease_dir = lease_dir
        self.texts: list[str] = []

    def on_train_batch_end(self, *args: Any) -> None:
        if not self.texts:
            self.texts = [p.read_text() for p in sorted(self.lease_dir.glob("*.json"))]


def _fit(tmp_path: Path, config: dict[str, Any]) -> tuple[EnergyCallback, LeaseReader]:
    callback = EnergyCallback(config)
    reader = LeaseReader(tmp_path / "leases")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[callback, reader],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(module_class(pl)(), make_loader(n=64))
    return callback, reader


def test_a_lightning_fit_changes_its_gpu_through_zeusd_and_hides_the_token(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        callback, reader = _fit(tmp_path, _config(tmp_path))
    assert callback.controller is not None and callback.controller.devices.backend == "zeusd"
    first = node.nvml.devices[0]
    limits_mw = [c[2] for c in node.nvml.calls if c[:2] == ("set_power_limit", first.uuid)]
    assert 300_000 in limits_mw  # profiled, through the daemon
    assert limits_mw[-1] == PRE_JOB_MW == first.limit_mw  # and put back
    assert all(c[1] == first.uuid for c in node.nvml.calls)  # the other GPU is left alone
    assert {path for path, _ in node.daemon.writes()} == {"/gpu/set_power_limit"}
    assert list((tmp_path / "leases").glob("*.json")) == []

    (lease,) = reader.texts
    assert json.loads(lease)["zeusd_address"] == node.daemon.address
    report = (tmp_path / "report.json").read_text()
    assert json.loads(report)  # written
    token = node.token
    assert token is not None
    for text in (lease, report, repr(callback.controller.devices.gpus)):
        assert token not in text
    assert caplog.records and all(token not in r.getMessage() for r in caplog.records)


def test_a_token_without_gpu_control_observes_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], scopes=["gpu-read"]) as n:
        with caplog.at_level(logging.WARNING, logger="lightning_energy"):
            callback, _ = _fit(tmp_path, _config(tmp_path))
        # One probe, refused: setting the limit the GPU already has; then nothing more.
        probe = {"gpu_ids": "0", "power_limit_mw": "400000", "block": "true"}
        assert n.daemon.writes() == [("/gpu/set_power_limit", probe)]
        assert n.nvml.calls == []
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = warning.getMessage()
    assert "lacks required scope 'gpu-control'" in text and "observe-only" in text
    assert "ZEUSD_TOKEN" in text  # how to get the permission, for zeusd
    assert callback.controller is not None
    report = json.loads((tmp_path / "report.json").read_text())
    assert "gpu-control" in json.dumps(report)  # the report says why


def test_strict_mode_fails_a_fit_whose_token_lacks_gpu_control(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with (
        zeusd_node(monkeypatch, tmp_path / "zeusd.sock", [a100(0)], scopes=["gpu-read"]) as n,
        pytest.raises(NoPermissionError, match="gpu-control"),
    ):
        _fit(tmp_path, _config(tmp_path, strict=True))
    assert n.nvml.calls == [] and list((tmp_path / "leases").glob("*.json")) == []
