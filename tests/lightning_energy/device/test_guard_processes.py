"""GPUGuard across real processes: SIGTERM and SIGKILL of a job, a second job on a leased
GPU, and recovery through the API, the CLI and the next job's acquire.

The jobs are ``guard_child.py`` run with ``sys.executable``; simulated GPUs keep their
settings in state files, as a driver would, so another process sees what a job left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.cli import main
from lightning_energy.device.guard import GPUGuard, recover
from lightning_energy.device.lease import Lease, LeaseStore, ProcessIdentity
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus
from lightning_energy.errors import LeaseConflictError

CHILD = Path(__file__).with_name("guard_child.py")


def read_power_w(state_dir: Path, uuid: str = "GPU-sim-a40-0") -> float:
    state = json.loads((state_dir / f"{uuid}.json").read_text(encoding="utf-8"))
    return float(state["power_limit_w"])


def lease_files(lease_dir: Path) -> list[str]:
    return sorted(p.name for p in lease_dir.glob("*.json")) if lease_dir.exists() else []


class Job:
    """A child process; ``ready`` is the JSON line it prints once set up."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child is ready (or dies)
        if not line:
            _, err = proc.communicate()
            pytest.fail(f"child exited early ({proc.returncode}): {err}")
        self.ready: dict[str, Any] = json.loads(line)

    def kill(self, signum: int) -> int:
        self.proc.send_signal(signum)
        self.proc.communicate()
        return self.proc.returncode


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "leases", tmp_path / "state"


@pytest.fixture
def start_job(dirs: tuple[Path, Path]) -> Iterator[Any]:
    lease_dir, state_dir = dirs
    jobs: list[Job] = []

    def start(mode: str = "hold", *extra: str) -> Job:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), mode, str(lease_dir), str(state_dir), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            job = Job(proc)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        if job.proc.poll() is None:
            job.kill(signal.SIGKILL)


def test_sigterm_restores_and_the_job_dies_of_sigterm(
    start_job: Any, dirs: tuple[Path, Path]
) -> None:
    lease_dir, state_dir = dirs
    job = start_job("hold", "--count", "2")
    assert job.ready["applied_w"] == 150.0 and not job.ready["observe_only"]
    assert [read_power_w(state_dir, f"GPU-sim-a40-{i}") for i in range(2)] == [150.0, 150.0]
    assert lease_files(lease_dir) == ["GPU-sim-a40-0.json", "GPU-sim-a40-1.json"]

    assert job.kill(signal.SIGTERM) == -signal.SIGTERM
    assert [read_power_w(state_dir, f"GPU-sim-a40-{i}") for i in range(2)] == [300.0, 300.0]
    assert lease_files(lease_dir) == []


def test_sigterm_chains_to_the_previous_handler(
    start_job: Any, dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    _, state_dir = dirs
    marker = tmp_path / "previous-handler-ran"
    job = start_job("hold", "--chain", str(marker))
    assert read_power_w(state_dir) == 150.0
    assert job.kill(signal.SIGTERM) == -signal.SIGTERM
    assert marker.read_text(encoding="utf-8") == "previous handler ran"
    assert read_power_w(state_dir) == 300.0


def test_atexit_restores_a_job_that_never_called_restore(
    start_job: Any, dirs: tuple[Path, Path]
) -> None:
    lease_dir, state_dir = dirs
    job = start_job("exit")
    assert job.ready["applied_w"] == 150.0
    _, err = job.proc.communicate()
    assert job.proc.returncode == 3  # the program's own exit status is kept
    assert "restored at interpreter exit" in err
    assert read_power_w(state_dir) == 300.0
    assert lease_files(lease_dir) == []


def test_second_job_on_a_leased_gpu_only_observes(start_job: Any, dirs: tuple[Path, Path]) -> None:
    lease_dir, state_dir = dirs
    job = start_job("hold")
    owner = job.ready["pid"]
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state_dir)))
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.observe_only
        assert f"pid {owner}" in (guard.observe_only_reason or "")
        assert guard.set_power_limit_w(120.0) == 150.0  # the first job's limit, untouched
    assert read_power_w(state_dir) == 150.0
    with pytest.raises(LeaseConflictError) as info:
        GPUGuard(gpus, lease_dir=lease_dir, strict=True).acquire()
    assert info.value.owner_pid == owner
    (result,) = recover(lease_dir)
    assert result.status == "skipped" and str(owner) in (result.owner or "")
    assert lease_files(lease_dir) == ["GPU-sim-a40-0.json"]
    assert job.kill(signal.SIGTERM) == -signal.SIGTERM
    assert read_power_w(state_dir) == 300.0


@pytest.mark.gpu_state_may_change
def test_sigkill_leaves_a_lease_that_recover_restores(
    start_job: Any, dirs: tuple[Path, Path]
) -> None:
    lease_dir, state_dir = dirs
    job = start_job("hold", "--count", "2", "--power-w", "180")
    assert job.kill(signal.SIGKILL) == -signal.SIGKILL
    assert lease_files(lease_dir) == ["GPU-sim-a40-0.json", "GPU-sim-a40-1.json"]
    assert read_power_w(state_dir) == 180.0

    results = recover(lease_dir)
    assert [(r.gpu_uuid, r.status) for r in results] == [
        ("GPU-sim-a40-0", "restored"),
        ("GPU-sim-a40-1", "restored"),
    ]
    assert "no longer running" in results[0].message
    assert [read_power_w(state_dir, f"GPU-sim-a40-{i}") for i in range(2)] == [300.0, 300.0]
    assert lease_files(lease_dir) == []


@pytest.mark.gpu_state_may_change
def test_a_forked_worker_that_outlives_a_killed_job_does_not_keep_its_lease(
    start_job: Any, dirs: tuple[Path, Path]
) -> None:
    """``flock`` belongs to the open file, which a forked child shares: a DataLoader
    worker still alive after the job was killed must not look like the job."""
    lease_dir, state_dir = dirs
    job = start_job("hold", "--fork-worker")
    worker = job.ready["worker"]
    try:
        job.proc.send_signal(signal.SIGKILL)
        assert job.proc.wait() == -signal.SIGKILL  # not communicate(): the worker has stdout
        os.kill(worker, 0)  # the worker lives on
        (result,) = recover(lease_dir)
        assert result.status == "restored", result.message
        assert read_power_w(state_dir) == 300.0
        gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state_dir)))
        with GPUGuard(gpus, lease_dir=lease_dir) as guard:
            assert not guard.observe_only, guard.observe_only_reason
    finally:
        os.kill(worker, signal.SIGKILL)


@pytest.mark.gpu_state_may_change
def test_sigkill_then_the_recover_command_restores(
    start_job: Any, dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    lease_dir, state_dir = dirs
    job = start_job("hold")
    assert job.kill(signal.SIGKILL) == -signal.SIGKILL

    assert main(["recover", "--lease-dir", str(lease_dir), "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in report["results"]] == ["would_restore"]
    assert read_power_w(state_dir) == 150.0 and lease_files(lease_dir)

    done = subprocess.run(
        [sys.executable, "-m", "lightning_energy", "recover", "--lease-dir", str(lease_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("restored  GPU-sim-a40-0")
    assert "power limit 300 W" in done.stdout
    assert read_power_w(state_dir) == 300.0
    assert lease_files(lease_dir) == []


@pytest.mark.gpu_state_may_change
def test_next_job_restores_what_a_killed_job_left(start_job: Any, dirs: tuple[Path, Path]) -> None:
    lease_dir, state_dir = dirs
    job = start_job("hold", "--power-w", "170")
    assert job.kill(signal.SIGKILL) == -signal.SIGKILL
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state_dir)))
    assert gpus[0].power_limit_w() == 170.0
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert not guard.observe_only
        assert guard.pre_job_power_limit_w(0) == 300.0  # not the 170 W the killed job left
        guard.set_power_limit_w(200.0)
    assert read_power_w(state_dir) == 300.0


@pytest.mark.gpu_state_may_change
def test_a_running_owner_without_its_lock_still_owns_the_lease(
    start_job: Any, dirs: tuple[Path, Path]
) -> None:
    lease_dir, state_dir = dirs
    job = start_job("identity")
    owner = ProcessIdentity(**job.ready)
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state_dir)))
    gpus[0].set_power_limit_w(190.0)  # as the owner set it
    lease = Lease(
        gpu_uuid=gpus[0].uuid,
        gpu_index=0,
        gpu_name=gpus[0].name,
        owner=owner,
        power_limit_w=300.0,
        locked_clocks_mhz=None,
        power_limit_changed=True,
        backend="simulated",
        simulated_gpu="a40",
        state_path=str(gpus[0].state_path),
    )
    LeaseStore(lease_dir).write(lease)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:  # pid and start time match: alive
        assert guard.observe_only and f"pid {owner.pid}" in (guard.observe_only_reason or "")
    assert job.kill(signal.SIGKILL) == -signal.SIGKILL
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:  # now stale: restored on acquire
        assert not guard.observe_only
        assert gpus[0].power_limit_w() == 300.0
    assert lease_files(lease_dir) == []
