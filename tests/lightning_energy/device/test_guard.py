"""GPUGuard in one process: exact restore on every exit path, clamping, roll-back,
observe-only modes, leases and stale-lease recovery."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import pytest

from lightning_energy.cli import main
from lightning_energy.device.guard import GPUGuard, recover
from lightning_energy.device.lease import (
    LEASE_DIR_ENV,
    Lease,
    LeaseStore,
    ProcessIdentity,
    owner_status,
    resolve_lease_dir,
)
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.errors import (
    ConfigError,
    GPULostError,
    GPUNotFoundError,
    LeaseConflictError,
    NoPermissionError,
    NotSupportedError,
)

GUARD_LOGGER = "lightning_energy.device.guard"


@pytest.fixture
def lease_dir(tmp_path: Path) -> Path:
    return tmp_path / "leases"


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def gpus_of(
    state_dir: Path | None,
    count: int = 1,
    gpu: str = "a40",
    *,
    permission_denied: bool = False,
    supports_setting: bool = True,
) -> list[SimulatedGPU]:
    spec = SimulatedSpec(
        gpu=gpu,
        count=count,
        state_dir=str(state_dir) if state_dir else None,
        permission_denied=permission_denied,
        supports_setting=supports_setting,
    )
    return simulated_gpus(spec)


def write_state(
    state_dir: Path, uuid: str, power_limit_w: float, locked: tuple[int, int] | None = None
) -> None:
    """Set a simulated GPU's settings as an operator (or a crashed job) left them."""
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {"uuid": uuid, "power_limit_w": power_limit_w, "locked_clocks_mhz": locked}
    (state_dir / f"{uuid}.json").write_text(json.dumps(state), encoding="utf-8")


def read_state(state_dir: Path, uuid: str) -> tuple[float, tuple[int, int] | None]:
    state = json.loads((state_dir / f"{uuid}.json").read_text(encoding="utf-8"))
    locked = state["locked_clocks_mhz"]
    return state["power_limit_w"], None if locked is None else tuple(locked)


def lease_files(lease_dir: Path) -> list[str]:
    return sorted(p.name for p in lease_dir.glob("*.json")) if lease_dir.exists() else []


def stale_lease(gpu: SimulatedGPU, owner: ProcessIdentity, power_limit_w: float) -> Lease:
    return Lease(
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        gpu_name=gpu.name,
        owner=owner,
        power_limit_w=power_limit_w,
        locked_clocks_mhz=None,
        power_limit_changed=True,
        backend="simulated",
        simulated_gpu="a40",
        state_path=str(gpu.state_path),
    )


# ------------------------------------------------------------------ exit paths
def test_normal_end_restores_the_exact_pre_job_values(lease_dir: Path, state_dir: Path) -> None:
    write_state(state_dir, "GPU-sim-a40-0", 280.0)  # operator caps below the 300 W default
    write_state(state_dir, "GPU-sim-a40-1", 250.0)
    gpus = gpus_of(state_dir, count=2)
    with GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False) as guard:
        assert guard.set_power_limit_w(150.0) == 150.0
        assert [g.power_limit_w() for g in gpus] == [150.0, 150.0]
        assert [guard.pre_job_power_limit_w(i) for i in range(2)] == [280.0, 250.0]
        assert lease_files(lease_dir) == ["GPU-sim-a40-0.json", "GPU-sim-a40-1.json"]
    assert [g.power_limit_w() for g in gpus] == [280.0, 250.0]  # not the default, not max
    assert read_state(state_dir, "GPU-sim-a40-0") == (280.0, None)
    assert lease_files(lease_dir) == []
    assert guard.restored and not guard.observe_only


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_exception_and_keyboard_interrupt_restore(lease_dir: Path, error: BaseException) -> None:
    gpus = gpus_of(None, count=2)
    with pytest.raises(type(error)), GPUGuard(gpus, lease_dir=lease_dir) as guard:
        guard.set_power_limit_w(120.0)
        raise error
    assert [g.power_limit_w() for g in gpus] == [300.0, 300.0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.usefixtures("default_signal_handlers")
def test_real_sigint_restores_then_raises_keyboard_interrupt(lease_dir: Path) -> None:
    gpus = gpus_of(None)
    with pytest.raises(KeyboardInterrupt), GPUGuard(gpus, lease_dir=lease_dir) as guard:
        guard.set_power_limit_w(120.0)
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("SIGINT did not interrupt")
    assert gpus[0].power_limit_w() == 300.0
    assert guard.restored
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _SignalDuringSet(SimulatedGPU):
    """Receives SIGINT in the middle of its first power-limit change."""

    sent = False

    def set_power_limit_w(self, power_limit_w: float) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        super().set_power_limit_w(power_limit_w)


def test_signal_arriving_during_a_change_is_handled_after_it(lease_dir: Path) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)  # a handler that does not stop the program

    original = signal.signal(signal.SIGINT, previous)
    try:
        gpu = _SignalDuringSet(SimulatedSpec(gpu="a40").model())
        guard = GPUGuard([gpu], lease_dir=lease_dir)
        guard.set_power_limit_w(150.0)
        # The change finished, then the signal restored the GPU and reached the old handler;
        # restoring in the middle would have left 150 W behind.
        assert calls == [signal.SIGINT]
        assert guard.restored
        assert gpu.power_limit_w() == 300.0
        assert guard.set_power_limit_w(150.0) == 300.0  # a restored guard changes nothing
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, original)


def test_restore_runs_exactly_once(lease_dir: Path) -> None:
    gpus = gpus_of(None)
    guard = GPUGuard(gpus, lease_dir=lease_dir)
    guard.set_power_limit_w(150.0)
    guard.restore()
    assert gpus[0].power_limit_w() == 300.0
    gpus[0].set_power_limit_w(200.0)  # somebody else changes it afterwards
    guard.restore()
    guard.__exit__(None, None, None)
    assert gpus[0].power_limit_w() == 200.0  # not re-applied
    gpus[0].set_power_limit_w(300.0)


def test_forked_child_never_restores(lease_dir: Path, state_dir: Path) -> None:
    gpus = gpus_of(state_dir)
    with GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False) as guard:
        guard.set_power_limit_w(150.0)
        pid = os.fork()
        if pid == 0:  # e.g. a data-loader worker exiting through the guard's code paths
            guard.restore()
            os._exit(0)
        os.waitpid(pid, 0)
        assert read_state(state_dir, "GPU-sim-a40-0") == (150.0, None)
        assert lease_files(lease_dir) == ["GPU-sim-a40-0.json"]
    assert read_state(state_dir, "GPU-sim-a40-0") == (300.0, None)


def test_outside_the_main_thread_no_handlers_are_installed(lease_dir: Path) -> None:
    gpus = gpus_of(None)
    seen: list[object] = []

    def job() -> None:
        with GPUGuard(gpus, lease_dir=lease_dir) as guard:
            guard.set_power_limit_w(150.0)
            seen.append(signal.getsignal(signal.SIGTERM))
            seen.append(gpus[0].power_limit_w())

    thread = threading.Thread(target=job, name="lightning-energy-test-job")
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL, 150.0]
    assert gpus[0].power_limit_w() == 300.0


# ------------------------------------------------------------------ clamping
def test_clamps_to_the_pre_job_limit_and_the_minimum(
    lease_dir: Path, state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_state(state_dir, "GPU-sim-a40-0", 250.0)
    gpus = gpus_of(state_dir)
    caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.set_power_limit_w(290.0) == 250.0  # within range, above the operator cap
        assert gpus[0].power_limit_w() == 250.0
        assert "above the pre-job limit 250 W" in caplog.text
        assert guard.set_power_limit_w(40.0) == 100.0
        assert gpus[0].power_limit_w() == 100.0
        assert "below the minimum" in caplog.text
    assert gpus[0].power_limit_w() == 250.0


def test_gpus_with_different_caps_get_one_limit(lease_dir: Path, state_dir: Path) -> None:
    write_state(state_dir, "GPU-sim-a40-1", 220.0)
    gpus = gpus_of(state_dir, count=2)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.set_power_limit_w(280.0) == 220.0
        assert [g.power_limit_w() for g in gpus] == [220.0, 220.0]
        assert guard.set_power_limit_w(260.0, gpus=[0]) == 260.0
        assert [g.power_limit_w() for g in gpus] == [260.0, 220.0]
    assert [g.power_limit_w() for g in gpus] == [300.0, 220.0]


def test_rejects_bad_arguments(lease_dir: Path) -> None:
    gpus = gpus_of(None, count=2)
    with pytest.raises(ConfigError, match="at least one GPU"):
        GPUGuard([], lease_dir=lease_dir)
    with pytest.raises(ConfigError, match="twice"):
        GPUGuard([gpus[0], gpus[0]], lease_dir=lease_dir)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        with pytest.raises(ConfigError, match="positions"):
            guard.set_power_limit_w(200.0, gpus=[2])
        with pytest.raises(ConfigError, match="finite"):
            guard.set_power_limit_w(float("nan"))
        with pytest.raises(ConfigError, match="min_mhz"):
            guard.lock_clocks_mhz(900, 600)
    assert [g.power_limit_w() for g in gpus] == [300.0, 300.0]


# ------------------------------------------------------------------ clocks
def test_clock_lock_is_capped_by_the_pre_job_lock_and_restored(
    lease_dir: Path, state_dir: Path
) -> None:
    write_state(state_dir, "GPU-sim-a100-0", 350.0, locked=(210, 1200))
    gpus = gpus_of(state_dir, gpu="a100")
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.pre_job_locked_clocks_mhz(0) == (210, 1200)
        assert guard.lock_clocks_mhz(600, 1410) == (600, 1200)
        assert gpus[0].locked_clocks_mhz() == (600, 1200)
        guard.reset_clocks()
        assert gpus[0].locked_clocks_mhz() == (210, 1200)  # back to the operator's lock
        guard.lock_clocks_mhz(300, 900)
        guard.set_power_limit_w(200.0)
    assert gpus[0].settings() == (350.0, (210, 1200))


def test_a_clock_reset_after_the_restore_leaves_the_released_gpu_alone(
    lease_dir: Path,
) -> None:
    """Two parts of a job share a guard; the owner restores first, the other resets late:
    the GPU, released, may belong to another job by then."""
    gpus = gpus_of(None, gpu="a100")
    guard = GPUGuard(gpus, lease_dir=lease_dir, install_signal_handlers=False)
    guard.lock_clocks_mhz(900, 900)
    guard.restore()
    gpus[0].set_locked_clocks_mhz(600, 600)  # the next job's lock
    guard.reset_clocks()
    assert gpus[0].locked_clocks_mhz() == (600, 600)
    gpus[0].reset_locked_clocks()  # the next job ends


def test_unlocked_clocks_are_unlocked_again(lease_dir: Path) -> None:
    gpus = gpus_of(None, count=2, gpu="a100")
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.lock_clocks_mhz(900, 900, gpus=[1]) == (900, 900)
        assert [g.locked_clocks_mhz() for g in gpus] == [None, (900, 900)]
    assert [g.locked_clocks_mhz() for g in gpus] == [None, None]


def test_gpu_without_clock_control_keeps_power_control(
    lease_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = gpus_of(None)  # trace-driven A40: no clock model
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.lock_clocks_mhz(600, 900) is None
        assert guard.lock_clocks_mhz(600, 900) is None
        assert not guard.observe_only
        assert guard.set_power_limit_w(200.0) == 200.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot lock its clocks" in warnings[0].getMessage()
    assert gpus[0].power_limit_w() == 300.0


# ------------------------------------------------------------------ failures
def test_failure_on_gpu_2_of_3_rolls_back_gpus_0_and_1(lease_dir: Path, state_dir: Path) -> None:
    write_state(state_dir, "GPU-sim-a40-1", 270.0)
    gpus = gpus_of(state_dir, count=3)
    gpus[2].inject_fault("set_power_limit", GPULostError)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.set_power_limit_w(150.0) == 270.0  # nothing applied: current limits
        assert [g.power_limit_w() for g in gpus] == [300.0, 270.0, 300.0]
        assert guard.observe_only
        assert "GPU 2" in (guard.observe_only_reason or "")
        guard.set_power_limit_w(150.0)
        assert [g.power_limit_w() for g in gpus] == [300.0, 270.0, 300.0]
    assert lease_files(lease_dir) == []


def test_strict_failure_rolls_back_then_raises(lease_dir: Path) -> None:
    gpus = gpus_of(None, count=3)
    gpus[2].inject_fault("set_power_limit", GPULostError)
    with GPUGuard(gpus, lease_dir=lease_dir, strict=True) as guard:
        guard.set_power_limit_w(200.0, gpus=[0, 1])
        with pytest.raises(GPULostError):
            guard.set_power_limit_w(150.0)
        assert [g.power_limit_w() for g in gpus] == [300.0, 300.0, 300.0]


def test_no_permission_is_observe_only_with_one_warning(
    lease_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = gpus_of(None, count=2, permission_denied=True)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert not guard.observe_only  # only a change tells whether it is allowed
        assert guard.set_power_limit_w(150.0) == 300.0
        assert guard.set_power_limit_w(120.0) == 300.0
        assert guard.lock_clocks_mhz(600, 900) is None
        assert guard.observe_only
        assert "no permission" in (guard.observe_only_reason or "")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    for advice in ("CAP_SYS_ADMIN", "root", "--cap-add SYS_ADMIN", "nvidia-smi -pm 1"):
        assert advice in message
    assert "securityContext" in message and "observe-only" in message
    assert [g.power_limit_w() for g in gpus] == [300.0, 300.0]
    assert lease_files(lease_dir) == []


def test_strict_no_permission_raises(lease_dir: Path) -> None:
    gpus = gpus_of(None, permission_denied=True)
    with (
        GPUGuard(gpus, lease_dir=lease_dir, strict=True) as guard,
        pytest.raises(NoPermissionError),
    ):
        guard.set_power_limit_w(150.0)
    assert gpus[0].power_limit_w() == 300.0


def test_unsupported_gpu_is_observe_only(lease_dir: Path) -> None:
    gpus = gpus_of(None, supports_setting=False)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert guard.set_power_limit_w(150.0) == 300.0
        assert "does not support" in (guard.observe_only_reason or "")


class _MigInstance(SimulatedGPU):
    @property
    def is_mig(self) -> bool:
        return True


def test_mig_instance_is_observe_only_or_raises_in_strict_mode(lease_dir: Path) -> None:
    gpu = _MigInstance(SimulatedSpec(gpu="a40").model())
    with GPUGuard([gpu], lease_dir=lease_dir) as guard:
        assert guard.observe_only and "MIG" in (guard.observe_only_reason or "")
        assert guard.set_power_limit_w(150.0) == 300.0
    with pytest.raises(NotSupportedError, match="MIG"):
        GPUGuard([gpu], lease_dir=lease_dir, strict=True).acquire()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_gpu_that_cannot_be_restored_keeps_its_lease(
    lease_dir: Path, state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = gpus_of(state_dir, count=2)
    guard = GPUGuard(gpus, lease_dir=lease_dir)
    guard.set_power_limit_w(150.0)
    gpus[0].inject_fault("set_power_limit", GPULostError)
    guard.restore()  # never raises: the other GPU is still restored
    assert "could not restore" in caplog.text and "lightning-energy recover" in caplog.text
    assert [g.power_limit_w() for g in gpus] == [150.0, 300.0]
    assert lease_files(lease_dir) == ["GPU-sim-a40-0.json"]
    lease = LeaseStore(lease_dir).read("GPU-sim-a40-0")
    assert lease is not None and lease.power_limit_changed and lease.power_limit_w == 300.0
    (result,) = recover(lease_dir)
    assert result.status == "skipped"  # its owner, this process, is alive
    gpus[0].clear_faults()
    gpus[0].set_power_limit_w(300.0)


# ------------------------------------------------------------------ leases
def test_lease_is_written_before_the_first_change(lease_dir: Path, state_dir: Path) -> None:
    gpus = gpus_of(state_dir)
    store = LeaseStore(lease_dir)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        lease = store.read("GPU-sim-a40-0")
        assert lease is not None
        me = ProcessIdentity.current()
        assert lease.owner == me and me.start_time is not None and me.boot_id
        assert (lease.power_limit_w, lease.locked_clocks_mhz) == (300.0, None)
        assert not lease.changed
        assert lease.backend == "simulated" and lease.simulated_gpu == "a40"
        assert lease.state_path == str(state_dir.absolute() / "GPU-sim-a40-0.json")
        guard.set_power_limit_w(200.0)
        changed = store.read("GPU-sim-a40-0")
        assert changed is not None and changed.power_limit_changed and not changed.clocks_changed
        assert changed.power_limit_w == 300.0  # still the pre-job value
    assert [p.name for p in lease_dir.iterdir() if p.suffix != ".lock"] == []


def test_in_memory_simulated_gpus_need_no_lease_file(lease_dir: Path) -> None:
    gpus = gpus_of(None)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        guard.set_power_limit_w(200.0)
        assert lease_files(lease_dir) == []
    assert gpus[0].power_limit_w() == 300.0


def test_lease_dir_comes_from_the_argument_env_or_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LEASE_DIR_ENV, raising=False)
    assert resolve_lease_dir().name == "lightning-energy"  # machine-wide, not per user
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "from-env"))
    assert GPUGuard(gpus_of(None)).lease_dir == tmp_path / "from-env"
    assert resolve_lease_dir(tmp_path / "arg") == tmp_path / "arg"


def test_second_guard_in_the_same_process_only_observes(lease_dir: Path, state_dir: Path) -> None:
    first_gpus, second_gpus = gpus_of(state_dir), gpus_of(state_dir)
    with GPUGuard(first_gpus, lease_dir=lease_dir) as first:
        first.set_power_limit_w(200.0)
        with GPUGuard(second_gpus, lease_dir=lease_dir) as second:
            assert second.observe_only
            assert f"pid {os.getpid()}" in (second.observe_only_reason or "")
        assert lease_files(lease_dir) == ["GPU-sim-a40-0.json"]
    assert read_state(state_dir, "GPU-sim-a40-0") == (300.0, None)


def test_owner_status_tells_live_reused_and_rebooted_owners() -> None:
    me = ProcessIdentity.current()
    assert owner_status(me, me)[0]
    assert me.start_time is not None
    reused = dataclasses.replace(me, start_time=me.start_time + 1)
    alive, why = owner_status(reused, me)
    assert not alive and "reused" in why
    rebooted = dataclasses.replace(me, boot_id="00000000-0000-0000-0000-000000000000")
    alive, why = owner_status(rebooted, me)
    assert not alive and "rebooted" in why
    elsewhere = dataclasses.replace(me, pid_namespace="pid:[1]")
    assert not owner_status(elsewhere, me)[0]  # the caller holds the lock: owner is gone


@pytest.mark.gpu_state_may_change
def test_stale_lease_of_a_reused_pid_is_restored_on_acquire(
    lease_dir: Path, state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_state(state_dir, "GPU-sim-a40-0", 150.0)  # what the crashed job left
    gpus = gpus_of(state_dir)
    me = ProcessIdentity.current()
    assert me.start_time is not None
    owner = dataclasses.replace(me, start_time=me.start_time - 1)
    LeaseStore(lease_dir).write(stale_lease(gpus[0], owner, 280.0))
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        assert not guard.observe_only
        assert gpus[0].power_limit_w() == 280.0
        assert guard.pre_job_power_limit_w(0) == 280.0
        lease = LeaseStore(lease_dir).read("GPU-sim-a40-0")
        assert lease is not None and lease.owner == me
    assert "crashed job" in caplog.text and "reused" in caplog.text
    assert read_state(state_dir, "GPU-sim-a40-0") == (280.0, None)
    assert lease_files(lease_dir) == []


@pytest.mark.gpu_state_may_change
def test_recover_restores_a_lease_from_before_a_reboot(lease_dir: Path, state_dir: Path) -> None:
    write_state(state_dir, "GPU-sim-a40-0", 150.0)
    gpu = gpus_of(state_dir)[0]
    owner = dataclasses.replace(ProcessIdentity.current(), boot_id="an-earlier-boot")
    LeaseStore(lease_dir).write(stale_lease(gpu, owner, 260.0))
    assert recover(lease_dir, dry_run=True)[0].status == "would_restore"
    assert read_state(state_dir, "GPU-sim-a40-0") == (150.0, None)
    (result,) = recover(lease_dir)
    assert result.status == "restored" and result.ok
    assert "rebooted" in result.message
    assert read_state(state_dir, "GPU-sim-a40-0") == (260.0, None)
    assert lease_files(lease_dir) == []


def test_recover_keeps_a_lease_whose_gpu_cannot_be_opened(
    lease_dir: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = gpus_of(state_dir)[0]
    owner = dataclasses.replace(ProcessIdentity.current(), boot_id="an-earlier-boot")
    LeaseStore(lease_dir).write(stale_lease(gpu, owner, 260.0))
    (lease_dir / "GPU-broken.json").write_text("{not json", encoding="utf-8")

    def open_gpu(uuid: str) -> SimulatedGPU:
        raise GPUNotFoundError(f"no GPU {uuid}", operation="get_handle")

    results = recover(lease_dir, open_gpu=open_gpu)
    assert [(r.gpu_uuid, r.status) for r in results] == [
        ("GPU-broken", "failed"),
        ("GPU-sim-a40-0", "failed"),
    ]
    assert "cannot open the GPU" in results[1].message and "lease kept" in results[1].message
    assert lease_files(lease_dir) == ["GPU-broken.json", "GPU-sim-a40-0.json"]
    assert main(["recover", "--lease-dir", str(lease_dir), "--dry-run"]) == 1
    assert "malformed lease" in capsys.readouterr().out


def test_recover_skips_leases_of_live_guards(lease_dir: Path, state_dir: Path) -> None:
    gpus = gpus_of(state_dir)
    with GPUGuard(gpus, lease_dir=lease_dir) as guard:
        guard.set_power_limit_w(200.0)
        (result,) = recover(lease_dir)
        assert result.status == "skipped" and "in use" in result.message
        assert read_state(state_dir, "GPU-sim-a40-0") == (200.0, None)
    assert recover(lease_dir) == []


def test_strict_mode_raises_on_a_live_lease(lease_dir: Path, state_dir: Path) -> None:
    with GPUGuard(gpus_of(state_dir), lease_dir=lease_dir):
        second = GPUGuard(gpus_of(state_dir), lease_dir=lease_dir, strict=True)
        with pytest.raises(LeaseConflictError) as info:
            second.acquire()
        assert info.value.owner_pid == os.getpid()


# ------------------------------------------------------------------ NVML re-open
def _nvml_lease(uuid: str, owner: ProcessIdentity, power_limit_w: float) -> Lease:
    return Lease(
        gpu_uuid=uuid,
        gpu_index=0,
        gpu_name="NVIDIA A100-SXM4-40GB",
        owner=owner,
        power_limit_w=power_limit_w,
        locked_clocks_mhz=None,
        power_limit_changed=True,
        clocks_changed=True,
    )


def test_recover_reopens_real_gpus_by_uuid_through_nvml(
    lease_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, NVMLError, a100, make_module

    device = a100(0, limit_mw=200_000, locked=(210, 1005))  # what the killed job left
    fake = make_module([device])

    def by_uuid(uuid: str) -> object:
        if uuid != device.uuid:
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])
        return device

    monkeypatch.setattr(fake, "nvmlDeviceGetHandleByUUID", by_uuid, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a by-UUID lookup ignores it
    me = ProcessIdentity.current()
    gone = dataclasses.replace(me, boot_id="an-earlier-boot")
    store = LeaseStore(lease_dir)
    store.write(_nvml_lease(device.uuid, gone, 350.0))
    store.write(_nvml_lease("GPU-not-on-this-node", gone, 300.0))
    store.write(
        _nvml_lease("GPU-of-another-node", dataclasses.replace(gone, hostname="elsewhere"), 300.0)
    )
    results = {r.gpu_uuid: r for r in recover(lease_dir)}
    assert results[device.uuid].status == "restored"
    assert (device.limit_mw, device.locked) == (350_000, None)
    assert results["GPU-not-on-this-node"].status == "failed"
    assert results["GPU-of-another-node"].status == "skipped"
    assert fake.init_calls == fake.shutdown_calls  # the re-opened GPU was closed
    assert lease_files(lease_dir) == ["GPU-not-on-this-node.json", "GPU-of-another-node.json"]


def test_recover_restores_a_gpu_past_a_lost_one_elsewhere_on_the_node(
    lease_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's by-UUID lookup initialises every GPU it meets and answers GPU_IS_LOST at a
    lost one before the GPU asked for: recover still finds and restores that GPU."""
    from tests.lightning_energy.device.fake_pynvml import a100, make_module

    lost = a100(0, lost=True)
    device = a100(1, limit_mw=200_000)
    fake = make_module([lost, device])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gone = dataclasses.replace(ProcessIdentity.current(), boot_id="an-earlier-boot")
    LeaseStore(lease_dir).write(_nvml_lease(device.uuid, gone, 350.0))
    (result,) = recover(lease_dir)
    assert result.status == "restored", result
    assert device.limit_mw == 350_000
