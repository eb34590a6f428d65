"""``lightning-energy history``: table and JSON output of recorded runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_energy.cli import main
from lightning_energy.optimize.batch_size import JobSpec, Trial
from lightning_energy.optimize.recurring import BatchSizeOptimizer
from lightning_energy.store import ENV_STORE_URL, Store


def _fill(url: str) -> None:
    spec = JobSpec(
        key="bert-squad",
        gpu_model="NVIDIA A40",
        gpu_count=2,
        default_batch_size=32,
        batch_sizes=(16, 32, 48),
        target_metric=84.0,
        max_epochs=6,
        max_power_limit_w=300.0,
    )
    with Store.open(url) as store:
        optimizer = BatchSizeOptimizer(spec, store, eta=0.5)
        runs = [
            (32, 225.0, 4, 2.4e6, 5400.0, True),
            (16, 200.0, 6, 3.1e6, 9000.0, False),
            (32, 225.0, 4, 2.2e6, 5300.0, True),
        ]
        for batch_size, limit, epochs, energy_j, time_s, converged in runs:
            optimizer.record(
                Trial(
                    batch_size=batch_size,
                    epochs=epochs,
                    energy_j=energy_j,
                    time_s=time_s,
                    converged=converged,
                    started_at=1.7e9,
                    finished_at=1.7e9 + time_s,
                    power_limit_w=limit,
                )
            )
        other = JobSpec(**{**spec.__dict__, "key": "other", "gpu_count": 1})
        BatchSizeOptimizer(other, store)


def test_table_lists_runs_and_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    _fill(url)
    assert main(["history", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "bert-squad on 2x NVIDIA A40" in out and "other on 1x NVIDIA A40" in out
    assert out.count(" yes\n") == 2 and out.count(" no\n") == 1
    assert "2.40 MJ" in out and "1h30m" in out and "225 W" in out
    assert "best: batch size 32 at 225 W" in out and "(2 converged runs)" in out
    assert "target 84.0 (higher is better)" in out
    assert "no runs yet" in out  # the job without runs


def test_json_for_one_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    _fill(url)
    monkeypatch.setenv(ENV_STORE_URL, url)
    assert main(["history", "--job", "bert-squad", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["store"] == url
    (job,) = data["jobs"]
    assert (job["key"], job["gpu_model"], job["gpu_count"]) == ("bert-squad", "NVIDIA A40", 2)
    assert job["settings"]["batch_sizes"] == [16, 32, 48]
    assert [t["batch_size"] for t in job["trials"]] == [32, 16, 32]
    assert [t["converged"] for t in job["trials"]] == [True, False, True]
    first = job["trials"][0]
    assert first["cost"] == pytest.approx(0.5 * 2.4e6 + 0.5 * 600.0 * 5400.0)
    assert job["best"]["batch_size"] == 32 and job["best"]["runs"] == 2
    assert job["best"]["mean_energy_j"] == pytest.approx(2.3e6)


def test_unknown_job_and_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    _fill(url)
    assert main(["history", "--store", url, "--job", "nope"]) == 1
    assert "known keys: bert-squad, other" in capsys.readouterr().err
    missing = f"sqlite:///{tmp_path / 'none.sqlite'}"
    assert main(["history", "--store", missing, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"store": missing, "jobs": []}
    assert not (tmp_path / "none.sqlite").exists()
    assert main(["history", "--store", "postgresql+nosuchdriver://u:pw@h/db"]) == 1
    err = capsys.readouterr().err
    assert "no database driver" in err and "pw@" not in err
