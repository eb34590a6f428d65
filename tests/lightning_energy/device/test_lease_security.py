"""The privileged path: a root ``recover`` (or a root job) over a lease directory other users
can write to. Every lease a user plants there is an attack to refuse or defuse.

The tests run as root (here and in CI): "another user" is a file ``os.chown``-ed to an
unprivileged uid. Where root is not available, ``trusted_uids`` stands in for it: the
test's own files are then treated as another user's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.cli import main
from lightning_energy.device import lease as lease_module
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.lease import (
    LEASE_DIR_ENV,
    Lease,
    LeaseStore,
    ProcessIdentity,
    resolve_lease_dir,
)
from lightning_energy.device.recovery import recover
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.errors import ConfigError, DeviceError
from tests.lightning_energy.device.fake_pynvml import (
    ERROR_CODES,
    FakeDevice,
    FakeNVML,
    NVMLError,
    a100,
    make_module,
)

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
USER_UID = 4242  # an unprivileged user: the attacker

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX ownership and modes")


@pytest.fixture
def lease_dir(tmp_path: Path) -> Path:
    path = tmp_path / "leases"
    path.mkdir(mode=0o700)
    path.chmod(0o1777)  # the shared directory of the Slurm/Kubernetes deployment
    return path


def dead_owner() -> ProcessIdentity:
    """An owner from before the last reboot: stale wherever it is read."""
    return dataclasses.replace(ProcessIdentity.current(), boot_id="an-earlier-boot")


def lease_dict(uuid: str, **overrides: Any) -> dict[str, Any]:
    lease = Lease(
        gpu_uuid=uuid,
        gpu_index=0,
        gpu_name="NVIDIA A100-SXM4-40GB",
        owner=dead_owner(),
        power_limit_w=100.0,
        locked_clocks_mhz=(210, 210),
        power_limit_changed=True,
        clocks_changed=True,
    )
    return {**lease.to_dict(), **overrides}


def plant(path: Path, content: bytes | str | dict[str, Any], uid: int | None = USER_UID) -> Path:
    """Write a file as the attacker would (owned by ``uid``)."""
    if isinstance(content, dict):
        content = json.dumps(content)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    if uid is not None and AS_ROOT:
        os.chown(path, uid, uid)
    return path


def trusted_uids() -> set[int] | None:
    """Root here: the defaults. Unprivileged: only root is trusted, so the test's own
    files stand for another user's."""
    return None if AS_ROOT else {0}


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """One A100 (100-400 W, default 400 W, clocks down to 210 MHz), reachable by UUID."""
    device = a100(0)
    fake = make_module([device])

    def by_uuid(uuid: str) -> FakeDevice:
        for d in fake.devices:
            if d.uuid == uuid:
                return d
        raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])

    monkeypatch.setattr(fake, "nvmlDeviceGetHandleByUUID", by_uuid, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


# ------------------------------------------------------------------ the attack
def test_planted_lease_cannot_lower_a_gpu_or_lock_its_clocks(
    lease_dir: Path, fake_nvml: FakeNVML, capsys: pytest.CaptureFixture[str]
) -> None:
    device = fake_nvml.devices[0]
    plant(lease_dir / f"{device.uuid}.json", lease_dict(device.uuid))
    results = recover(lease_dir, trusted_uids=trusted_uids())
    assert (device.limit_mw, device.locked) == (400_000, None)
    assert fake_nvml.calls == []  # nothing was even tried
    (result,) = results
    assert result.status == "refused" and result.ok
    owner_uid = (lease_dir / f"{device.uuid}.json").stat().st_uid
    assert f"uid {owner_uid}" in result.message and "lower" in result.message
    assert (lease_dir / f"{device.uuid}.json").exists()  # kept for the administrator


def test_planted_lease_cannot_make_root_write_a_file(lease_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "root-only" / "authorized_keys"
    victim.parent.mkdir(mode=0o700)
    planted = lease_dict(
        "GPU-sim-a40-0",
        gpu_uuid="GPU-sim-a40-0",
        backend="simulated",
        simulated_gpu="a40",
        state_path=str(victim),
    )
    plant(lease_dir / "GPU-sim-a40-0.json", planted)
    (result,) = recover(lease_dir, trusted_uids=trusted_uids())
    assert result.status == "refused" and "state file" in result.message
    assert not victim.exists()
    if AS_ROOT:
        assert main(["recover", "--lease-dir", str(lease_dir)]) == 0
        assert not victim.exists()


def test_a_fifo_named_like_a_lease_does_not_hang_recover(lease_dir: Path) -> None:
    os.mkfifo(lease_dir / "GPU-fifo.json")
    (result,) = recover(lease_dir)
    assert result.status == "refused" and "not a regular file" in result.message


def test_a_symlinked_lease_is_not_followed(lease_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "root-lease.json"
    elsewhere.write_text(json.dumps(lease_dict("GPU-sim-a40-0")), encoding="utf-8")
    (lease_dir / "GPU-sim-a40-0.json").symlink_to(elsewhere)

    def open_gpu(uuid: str) -> SimulatedGPU:
        raise AssertionError(f"{uuid} must not be opened")

    (result,) = recover(lease_dir, open_gpu=open_gpu)
    assert result.status == "refused" and "symbolic link" in result.message
    assert elsewhere.exists()


@pytest.mark.skipif(not AS_ROOT, reason="hard links to another user's file need root")
def test_a_hard_link_to_a_root_file_is_refused(lease_dir: Path, tmp_path: Path) -> None:
    root_file = tmp_path / "kept.json"
    root_file.write_text(json.dumps(lease_dict("GPU-sim-a40-0")), encoding="utf-8")
    os.link(root_file, lease_dir / "GPU-sim-a40-0.json")
    (result,) = recover(lease_dir)
    assert result.status == "refused" and "hard link" in result.message


def test_an_oversized_lease_is_refused_unread(lease_dir: Path) -> None:
    plant(lease_dir / "GPU-big.json", b" " * (lease_module.MAX_LEASE_BYTES + 1))
    (result,) = recover(lease_dir)
    assert result.status == "refused" and "larger than" in result.message


def test_a_lease_must_describe_the_gpu_it_is_named_after(lease_dir: Path) -> None:
    plant(lease_dir / "GPU-decoy.json", lease_dict("GPU-sim-a40-0"), uid=None)
    (result,) = recover(lease_dir)
    assert result.status == "failed" and "GPU-sim-a40-0" in result.message


@pytest.mark.gpu_state_may_change
def test_a_root_lease_is_restored_but_never_lowers_the_gpu(
    lease_dir: Path, fake_nvml: FakeNVML
) -> None:
    device = fake_nvml.devices[0]
    device.limit_mw, device.locked = 250_000, (210, 1005)  # what the killed job left
    store = LeaseStore(lease_dir)
    store.write(Lease.from_dict(lease_dict(device.uuid, locked_clocks_mhz=None)))
    (result,) = recover(lease_dir)
    assert result.status == "restored", result.message
    assert (device.limit_mw, device.locked) == (250_000, None)  # never lowers a limit
    assert "kept 250 W" in result.message
    store.write(
        Lease.from_dict(lease_dict(device.uuid, power_limit_w=5000.0, clocks_changed=False))
    )
    (result,) = recover(lease_dir)
    assert device.limit_mw == 400_000  # capped to the driver's maximum


@pytest.mark.skipif(not AS_ROOT, reason="needs a file owned by another uid")
def test_another_users_lease_only_puts_the_gpu_back_to_its_defaults(
    lease_dir: Path, fake_nvml: FakeNVML
) -> None:
    device = fake_nvml.devices[0]
    device.limit_mw, device.locked = 150_000, (210, 210)  # what the user's killed job left
    device.default_limit_mw = 350_000
    path = lease_dir / f"{device.uuid}.json"
    # the user claims the GPU was at 400 W with clocks locked at 1410 MHz before the job
    plant(path, lease_dict(device.uuid, power_limit_w=400.0, locked_clocks_mhz=[1410, 1410]))
    (result,) = recover(lease_dir, trusted_uids={0})
    assert result.status == "restored", result.message
    assert (device.limit_mw, device.locked) == (350_000, None)  # the default, unlocked
    assert not path.exists()


# ------------------------------------------------------------------ the directory
def test_world_writable_directory_without_sticky_bit_is_refused(
    lease_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lease_dir.chmod(0o777)
    with pytest.raises(DeviceError, match="sticky"):
        recover(lease_dir)
    assert main(["recover", "--lease-dir", str(lease_dir)]) == 1
    assert "sticky" in capsys.readouterr().err
    with pytest.raises(DeviceError, match="sticky"):
        LeaseStore(lease_dir).write(Lease.from_dict(lease_dict("GPU-sim-a40-0")))


@pytest.mark.skipif(not AS_ROOT, reason="needs a directory owned by another uid")
def test_directory_owned_by_another_user_is_refused(lease_dir: Path) -> None:
    os.chown(lease_dir, USER_UID, USER_UID)
    lease_dir.chmod(0o755)
    with pytest.raises(DeviceError, match=f"uid {USER_UID}"):
        recover(lease_dir)


def test_a_new_lease_directory_is_sticky_and_shared(tmp_path: Path) -> None:
    lease_dir = tmp_path / "new" / "leases"
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(tmp_path / "state")))
    with GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False) as guard:
        guard.set_power_limit_w(200.0)
        mode = stat.S_IMODE(lease_dir.stat().st_mode)
        assert mode == 0o1777
        assert stat.S_IMODE((lease_dir / "GPU-sim-a40-0.json").stat().st_mode) == 0o644


def test_the_default_lease_directory_is_machine_wide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LEASE_DIR_ENV, raising=False)
    seen = set()
    for user in ("alice", "bob"):
        monkeypatch.setenv("HOME", str(tmp_path / user))
        monkeypatch.delenv("XDG_STATE_HOME", raising=False)
        seen.add(resolve_lease_dir())
    (shared,) = seen
    assert not shared.is_relative_to(tmp_path)


@pytest.mark.gpu_state_may_change
def test_a_second_job_of_another_user_observes_and_names_the_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "run" / "lightning-energy"
    monkeypatch.setattr(lease_module, "DEFAULT_LEASE_DIR", shared)
    monkeypatch.delenv(LEASE_DIR_ENV, raising=False)
    state = tmp_path / "state"
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    first = GPUGuard(
        simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state))),
        install_signal_handlers=False,
    )
    with first:
        first.set_power_limit_w(100.0)  # profiling
        monkeypatch.setenv("HOME", str(tmp_path / "bob"))
        gpus = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(state)))
        with GPUGuard(gpus, install_signal_handlers=False) as second:
            assert second.observe_only
            assert f"pid {os.getpid()}" in (second.observe_only_reason or "")
            assert second.set_power_limit_w(250.0) == 100.0  # changes nothing
    after = SimulatedGPU(
        SimulatedSpec(gpu="a40").model(),
        uuid="GPU-sim-a40-0",
        state_path=state / "GPU-sim-a40-0.json",
    )
    assert after.power_limit_w() == 300.0


# ------------------------------------------------------------------ the CLI
def test_recover_with_an_empty_lease_dir_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["recover", "--lease-dir", ""]) == 2
    assert "--lease-dir" in capsys.readouterr().err


def test_recover_explains_a_refused_lease(
    lease_dir: Path, fake_nvml: FakeNVML, capsys: pytest.CaptureFixture[str]
) -> None:
    if not AS_ROOT:
        pytest.skip("the command trusts the caller's own files")
    device = fake_nvml.devices[0]
    plant(lease_dir / f"{device.uuid}.json", lease_dict(device.uuid))
    assert main(["recover", "--lease-dir", str(lease_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("refused") and f"uid {USER_UID}" in out
    assert device.limit_mw == 400_000


def test_a_symlinked_lock_file_is_not_followed(lease_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "created-by-root"
    (lease_dir / "GPU-sim-a40-0.lock").symlink_to(victim)
    plant(lease_dir / "GPU-sim-a40-0.json", lease_dict("GPU-sim-a40-0"), uid=None)
    (result,) = recover(lease_dir)
    assert result.status == "refused" and "symbolic link" in result.message
    assert not victim.exists()


@pytest.mark.skipif(not AS_ROOT, reason="needs a file owned by another uid")
def test_a_root_job_never_applies_a_planted_lease(
    lease_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", state_dir=str(tmp_path / "state")))
    planted = lease_dict(
        gpus[0].uuid,
        gpu_name=gpus[0].name,
        backend="simulated",
        simulated_gpu="a100",
        state_path=str(gpus[0].state_path),
    )
    plant(lease_dir / f"{gpus[0].uuid}.json", planted)
    with GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False) as job:
        assert job.observe_only and "uid 4242" in (job.observe_only_reason or "")
        assert job.set_power_limit_w(200.0) == gpus[0].default_power_limit_w()
    assert gpus[0].settings() == gpus[0].initial_settings


@pytest.mark.skipif(not AS_ROOT, reason="switches to another uid")
def test_another_user_cannot_replace_or_remove_a_root_lease() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)  # reachable by the other user
        lease_dir = Path(tmp) / "leases"
        root_store = LeaseStore(lease_dir)
        root_lease = Lease.from_dict(lease_dict("GPU-sim-a40-0", power_limit_w=300.0))
        root_store.write(root_lease)
        assert stat.S_IMODE(lease_dir.stat().st_mode) == 0o1777
        forged = dataclasses.replace(root_lease, power_limit_w=100.0)
        os.setegid(USER_UID)
        os.seteuid(USER_UID)
        try:
            user_store = LeaseStore(lease_dir)
            with pytest.raises(DeviceError, match="write lease"):
                user_store.write(forged)
            with pytest.raises(DeviceError, match="remove lease"):
                user_store.remove("GPU-sim-a40-0")
        finally:
            os.seteuid(0)
            os.setegid(0)
        assert root_store.read("GPU-sim-a40-0") == root_lease


@pytest.mark.parametrize("bad", ["", "  ", 123, ["/run"]])
def test_a_lease_dir_that_is_not_a_path_is_named(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"lease_dir: .* is not allowed"):
        resolve_lease_dir(bad)
    with pytest.raises(ConfigError, match=r"lease_dir: .* is not allowed"):
        GPUGuard(simulated_gpus(SimulatedSpec(gpu="a40")), lease_dir=bad)
