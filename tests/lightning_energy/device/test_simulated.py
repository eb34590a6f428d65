"""The simulated GPU: virtual clock, energy accounting, noise, stragglers, faults, state."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_energy.device import (
    GPU,
    PHYSICS_PRESETS,
    SimulatedGPU,
    SimulatedSpec,
    StageWork,
    VirtualClock,
    live_simulated_gpus,
    run_in_parallel,
    simulated_gpus,
    work_runner,
)
from lightning_energy.device.base import LeaseSource
from lightning_energy.errors import (
    ConfigError,
    DriverError,
    GPULostError,
    NoPermissionError,
    NotSupportedError,
)
from tests.lightning_energy.device.ideal_board import IDEAL


def test_virtual_clock_moves_only_when_told_and_is_thread_safe() -> None:
    clock = VirtualClock(start_s=5.0)
    assert clock.now() == 5.0
    clock.advance(1.5)
    clock.sleep(0.5)
    assert clock.now() == 7.0
    with pytest.raises(ConfigError):
        clock.advance(-1.0)

    def tick() -> None:
        for _ in range(1000):
            clock.advance(0.001)

    threads = [threading.Thread(target=tick) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.now() == pytest.approx(11.0)


def test_implements_the_gpu_protocol_with_deterministic_identity() -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", count=2, first_index=3))
    assert all(isinstance(g, GPU) for g in gpus)
    assert [g.index for g in gpus] == [3, 4]
    assert [g.uuid for g in gpus] == ["GPU-sim-a100-3", "GPU-sim-a100-4"]
    assert gpus[0].clock is gpus[1].clock
    assert not gpus[0].is_mig
    assert gpus[0].enforced_power_limit_w() == gpus[0].power_limit_w()
    custom = simulated_gpus(SimulatedSpec(uuid_prefix="GPU-x"))[0]
    assert custom.uuid == "GPU-x-0"


def test_idle_time_and_other_gpus_work_are_charged_at_idle_power() -> None:
    a, b = simulated_gpus(SimulatedSpec(gpu="a100", count=2, **IDEAL))
    assert a.power_w() == 70.0
    a.run_work(1.0, 1.0)  # 380 W for 1 s on a; b waits.
    assert a.energy_j() == pytest.approx(380.0)
    assert a.power_w() == pytest.approx(380.0)
    assert b.energy_j() == pytest.approx(70.0)
    a.idle(2.0)
    assert a.energy_j() == pytest.approx(380.0 + 140.0)
    assert a.power_w() == 70.0
    a.synchronize()


def test_parallel_steps_advance_the_clock_by_the_slowest_gpu() -> None:
    fast, slow = simulated_gpus(SimulatedSpec(gpu="a100", count=2, slowdowns=(1.0, 1.5), **IDEAL))
    start = fast.clock.now()
    duration = run_in_parallel([fast, slow], steps=2)
    assert duration == pytest.approx(2 * 0.25 * 1.5)
    assert fast.clock.now() - start == pytest.approx(duration)
    step_power = PHYSICS_PRESETS["a100"].work_power_w(0.85, 1410)
    assert fast.energy_j() == pytest.approx(step_power * 0.5 + 70.0 * 0.25)
    assert slow.energy_j() == pytest.approx(step_power * 0.75)
    other = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with pytest.raises(ConfigError, match="share one VirtualClock"):
        run_in_parallel([fast, other])


def test_straggler_takes_longer_at_the_same_power() -> None:
    normal, straggler = simulated_gpus(
        SimulatedSpec(gpu="a40", count=2, slowdowns=(1.0, 1.3), **IDEAL)
    )
    assert straggler.slowdown == 1.3
    normal_s = normal.run_step()
    normal_w = normal.power_w()
    straggler_s = straggler.run_step()
    assert straggler_s == pytest.approx(1.3 * normal_s)
    assert straggler.power_w() == pytest.approx(normal_w)


def test_noise_is_seeded_and_reproducible() -> None:
    def durations(seed: int) -> list[float]:
        gpu = simulated_gpus(SimulatedSpec(gpu="a40", noise_std=0.05, seed=seed))[0]
        return [gpu.run_step() for _ in range(5)] + [gpu.energy_j()]

    first, again, other = durations(1), durations(1), durations(2)
    assert first == again
    assert first != other
    assert len(set(first[:5])) == 5
    quiet = simulated_gpus(SimulatedSpec(gpu="a40"))[0]
    assert min(first[:5]) < quiet.run_step() * 1.2


def test_gpus_of_one_spec_get_different_noise() -> None:
    a, b = simulated_gpus(SimulatedSpec(gpu="a40", noise_std=0.05, count=2))
    assert a.run_step() != b.run_step()


def test_fault_after_calls_and_times() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    gpu.inject_fault("set_power_limit", NoPermissionError, after_calls=1, times=2)
    gpu.set_power_limit_w(300.0)
    for _ in range(2):
        with pytest.raises(NoPermissionError) as info:
            gpu.set_power_limit_w(250.0)
        assert info.value.gpu_index == 0
        assert info.value.operation == "set_power_limit"
    gpu.set_power_limit_w(400.0)
    assert gpu.power_limit_w() == 400.0


def test_fault_instance_is_raised_as_given() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    error = NotSupportedError("no counter", gpu_index=0, operation="energy")
    gpu.inject_fault("energy", error)
    for _ in range(3):
        with pytest.raises(NotSupportedError) as info:
            gpu.energy_j()
        assert info.value is error
    gpu.clear_faults()
    assert gpu.energy_j() == 0.0


def test_gpu_lost_mid_run_fails_every_protocol_call() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    gpu.inject_fault("any", GPULostError, after_calls=2)
    gpu.energy_j()
    gpu.power_limit_w()
    gpu.run_step()  # workload operations are not protocol calls: they are not counted
    for call in (gpu.energy_j, gpu.power_w, gpu.synchronize, gpu.reset_locked_clocks):
        with pytest.raises(GPULostError):
            call()
    with pytest.raises(ConfigError, match="allowed"):
        gpu.inject_fault("explode", GPULostError)


def test_workload_operations_fail_when_named() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    gpu.inject_fault("run_step", GPULostError, times=1)
    with pytest.raises(GPULostError):
        gpu.run_step()
    assert gpu.run_step() == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (SimulatedSpec(gpu="a100", permission_denied=True), NoPermissionError),
        (SimulatedSpec(gpu="a100", supports_setting=False), NotSupportedError),
    ],
)
def test_setters_refused_by_flags(spec: SimulatedSpec, error: type[Exception]) -> None:
    gpu = simulated_gpus(spec)[0]
    for call in (
        lambda: gpu.set_power_limit_w(200.0),
        lambda: gpu.set_locked_clocks_mhz(900, 900),
        gpu.reset_locked_clocks,
    ):
        with pytest.raises(error):
            call()
    assert gpu.power_limit_w() == 400.0  # reading still works


def test_invalid_work_arguments() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with pytest.raises(ConfigError) as info:
        gpu.run_work(-1.0, 2.0)
    assert len(info.value.problems) == 2
    with pytest.raises(ConfigError, match=r"slowdown: 0\.5 is not allowed"):
        SimulatedGPU(gpu.model, slowdown=0.5)


@pytest.mark.gpu_state_may_change
def test_state_persists_across_instances(tmp_path: Path) -> None:
    spec = SimulatedSpec(gpu="a100", state_dir=str(tmp_path))
    first = simulated_gpus(spec)[0]
    assert first.state_path == tmp_path / "GPU-sim-a100-0.json"
    first.set_power_limit_w(250.0)
    first.set_locked_clocks_mhz(1005, 1005)
    second = simulated_gpus(spec)[0]
    assert second.power_limit_w() == 250.0
    assert second.locked_clocks_mhz() == (1005, 1005)
    assert second.initial_settings == (250.0, (1005, 1005))
    assert json.loads(first.state_path.read_text())["uuid"] == "GPU-sim-a100-0"
    assert [p.name for p in tmp_path.iterdir()] == ["GPU-sim-a100-0.json"]  # no temp files left


def test_lease_source_clock_and_idle(tmp_path: Path) -> None:
    in_memory = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    assert in_memory.lease_source() == LeaseSource(
        "simulated", persistent=False, simulated_gpu="a100"
    )
    kept = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(tmp_path)))[0]
    assert kept.lease_source() == LeaseSource(
        "simulated",
        persistent=True,
        simulated_gpu="a40",
        state_path=str(tmp_path.absolute() / "GPU-sim-a40-0.json"),
    )
    start_s = kept.now_s()
    assert start_s == kept.clock.now()
    energy_j = kept.energy_j()
    kept.idle(2.5)
    assert kept.now_s() == start_s + 2.5
    assert kept.energy_j() > energy_j  # idling draws idle power


@pytest.mark.gpu_state_may_change
def test_state_left_by_a_killed_process_is_seen_by_the_next(tmp_path: Path) -> None:
    worker = Path(__file__).with_name("killed_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], check=False)
    assert proc.returncode == -9
    gpu = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=str(tmp_path)))[0]
    assert gpu.power_limit_w() == 150.0


def test_bad_state_files_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "GPU-sim-a100-0.json"
    path.write_text("{not json")
    with pytest.raises(DriverError, match="malformed"):
        simulated_gpus(SimulatedSpec(gpu="a100", state_dir=str(tmp_path)))
    path.write_text(
        json.dumps({"uuid": "GPU-other", "power_limit_w": 300, "locked_clocks_mhz": None})
    )
    with pytest.raises(DriverError, match="belongs to GPU-other"):
        simulated_gpus(SimulatedSpec(gpu="a100", state_dir=str(tmp_path)))


def test_live_registry_tracks_constructed_gpus() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    assert gpu in live_simulated_gpus()
    gpu.set_power_limit_w(300.0)
    assert gpu.settings() != gpu.initial_settings
    gpu.set_power_limit_w(400.0)
    assert gpu.settings() == gpu.initial_settings


def test_conftest_fails_a_test_that_leaves_gpu_settings_changed(tmp_path: Path) -> None:
    conftest = Path(__file__).parents[2] / "conftest.py"
    (tmp_path / "conftest.py").write_text(conftest.read_text())
    (tmp_path / "test_leaky.py").write_text(
        "import pytest\n"
        "from lightning_energy.device import SimulatedSpec, simulated_gpus\n"
        "KEPT = simulated_gpus(SimulatedSpec(gpu='a100'))\n"
        "def test_limit_left_lowered():\n"
        "    simulated_gpus(SimulatedSpec(gpu='a100', uuid_prefix='GPU-leak'))[0]"
        ".set_power_limit_w(200.0)\n"
        "def test_restored():\n"
        "    gpu = simulated_gpus(SimulatedSpec(gpu='a100'))[0]\n"
        "    gpu.set_locked_clocks_mhz(900, 900)\n"
        "    gpu.reset_locked_clocks()\n"
        "def test_module_gpu_left_locked():\n"
        "    KEPT[0].set_locked_clocks_mhz(900, 900)\n"
        "@pytest.mark.gpu_state_may_change\n"
        "def test_marked():\n"
        "    KEPT[0].set_power_limit_w(300.0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "-rA"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    out = proc.stdout
    assert "GPU settings left changed" in out
    assert "ERROR test_leaky.py::test_limit_left_lowered" in out
    assert "GPU-leak-0: (400.0, None) -> (200.0, None)" in out
    assert "ERROR test_leaky.py::test_module_gpu_left_locked" in out
    assert "(400.0, None) -> (400.0, (900, 900))" in out
    assert "PASSED test_leaky.py::test_restored" in out
    assert "ERROR test_leaky.py::test_restored" not in out
    assert "ERROR test_leaky.py::test_marked" not in out


def test_a_simulated_gpu_runs_the_work_it_is_given_on_its_virtual_clock() -> None:
    """``work_runner``: a data-parallel step's compute advances the simulated GPU's clock by
    its time and draws its energy; the readings bracket the compute."""
    (gpu,) = simulated_gpus(SimulatedSpec(gpu="a100"))
    runner = work_runner(gpu)
    assert runner is not None
    step = runner.data_parallel(StageWork(0.5, 0.9))
    start_s, start_j = gpu.clock.now(), gpu.energy_j()
    compute_s = step.compute()
    assert gpu.clock.now() - start_s == pytest.approx(compute_s)
    assert compute_s >= 0.5  # at most the maximum clock's speed
    start, compute_end, end = step.all_reduce()  # one process: nobody to wait for
    assert start == (start_s, start_j)
    assert compute_end[0] - start[0] == pytest.approx(compute_s)
    assert compute_end[1] > start_j
    assert end == compute_end


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("power_limit_w", "1" + "0" * 400),
        ("power_limit_w", "-1" + "0" * 400),
        ("power_limit_w", "1e400"),
        ("locked_clocks_mhz", "[1e400, 1410]"),
        ("locked_clocks_mhz", "[1410, 1%s]" % ("0" * 400)),
    ],
)
def test_a_state_file_number_no_float_holds_is_named(
    tmp_path: Path, field: str, value: str
) -> None:
    fields = {"uuid": '"GPU-sim-a100-0"', "power_limit_w": "300", "locked_clocks_mhz": "null"}
    fields[field] = value
    text = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
    (tmp_path / "GPU-sim-a100-0.json").write_text(text)
    with pytest.raises(DriverError, match=f"malformed.*{field}"):
        simulated_gpus(SimulatedSpec(gpu="a100", state_dir=str(tmp_path)))
