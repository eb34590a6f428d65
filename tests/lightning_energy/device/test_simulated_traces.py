"""The trace-driven model replays the Zeus power files exactly and interpolates between them."""

from __future__ import annotations

import csv
import importlib.resources
from pathlib import Path

import pytest

from lightning_energy.device import PowerTrace, SimulatedSpec, TraceModel, simulated_gpus
from lightning_energy.errors import ConfigError, NotSupportedError, ProfileError
from tests.lightning_energy.device.ideal_board import IDEAL

HEADER = "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"


def _rows(name: str) -> list[dict[str, str]]:
    profiles = importlib.resources.files("lightning_energy") / "data" / "gpu_profiles"
    text = (profiles / f"zeus_summary_power_{name}.csv").read_text()
    return list(csv.DictReader(text.splitlines()))


@pytest.mark.parametrize("name", ["a40", "v100"])
def test_every_row_of_the_shipped_traces_is_reproduced(name: str) -> None:
    trace = PowerTrace.load(name)
    seen_optimizer: dict[tuple[str, str, int], str] = {}
    for row in _rows(name):
        key = (row["dataset"], row["network"], int(row["batch_size"]))
        seen_optimizer.setdefault(key, row["optimizer"])
        workload = trace.workload(*key, optimizer=row["optimizer"])
        limit_w = float(row["power_limit"])
        assert workload.time_per_epoch_s(limit_w) == float(row["time_per_epoch"])
        assert workload.average_power_w(limit_w) == float(row["average_power"])
    # Without an optimizer, the first measured one is replayed.
    for key, optimizer in seen_optimizer.items():
        assert trace.workload(*key).optimizer == optimizer


def test_interpolates_linearly_between_measured_limits_and_clamps_outside() -> None:
    workload = PowerTrace.load("a40").workload("imagenet", "resnet50", 128)
    # a40 imagenet/resnet50/128: 200 W -> 3992.39 s, 179.226 W; 225 W -> 3862.42 s, 198.381 W
    assert workload.time_per_epoch_s(212.5) == pytest.approx((3992.39 + 3862.42) / 2)
    assert workload.average_power_w(205.0) == pytest.approx(
        179.22631615034337 + 0.2 * (198.38104893564224 - 179.22631615034337)
    )
    assert workload.time_per_epoch_s(50.0) == workload.time_per_epoch_s(100.0)
    assert workload.time_per_epoch_s(400.0) == workload.time_per_epoch_s(300.0)


def test_simulated_step_replays_the_trace_at_the_current_limit() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=50, **IDEAL))[0]
    assert gpu.name == "NVIDIA A40 (simulated)"
    assert gpu.power_limit_constraints_w() == (100.0, 300.0)
    assert gpu.default_power_limit_w() == 300.0 == gpu.power_limit_w()
    for limit_w, epoch_s, power_w in [
        (300.0, 3739.5, 244.26058546458663),
        (175.0, 4463.24, 160.86341752430866),
    ]:
        gpu.set_power_limit_w(limit_w)
        start_s, start_j = gpu.clock.now(), gpu.energy_j()
        duration_s = gpu.run_step(2)
        assert duration_s == pytest.approx(2 * epoch_s / 50)
        assert gpu.clock.now() - start_s == pytest.approx(duration_s)
        assert gpu.energy_j() - start_j == pytest.approx(power_w * duration_s)
        assert gpu.power_w() == pytest.approx(power_w)
    gpu.set_power_limit_w(300.0)


def test_default_workload_and_batch_size() -> None:
    model = SimulatedSpec(gpu="v100").model()
    assert isinstance(model, TraceModel)
    # imagenet/resnet50 on the V100: 8, 16, 32, 64, 128, 192, 256, 360 -> index 8 // 2.
    assert (model.workload.dataset, model.workload.network) == ("imagenet", "resnet50")
    assert model.workload.batch_size == 128
    assert model.name == "NVIDIA V100"


def test_work_slows_only_the_compute_bound_share() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a40", **IDEAL))[0]
    ratio = 4463.24 / 3739.5  # imagenet/resnet50/128 at 175 W vs 300 W
    gpu.set_power_limit_w(175.0)
    assert gpu.run_work(1.0, 1.0) == pytest.approx(ratio)
    assert gpu.run_work(1.0, 0.0) == pytest.approx(1.0)
    assert gpu.run_work(1.0, 0.5) == pytest.approx(0.5 * ratio + 0.5)
    gpu.set_power_limit_w(300.0)


def test_trace_gpus_do_not_model_clocks() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a40"))[0]
    with pytest.raises(NotSupportedError, match="physics preset"):
        gpu.supported_sm_clocks_mhz()
    with pytest.raises(NotSupportedError):
        gpu.set_locked_clocks_mhz(900, 900)
    assert gpu.locked_clocks_mhz() is None


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + body)
    return path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("d,n,8,sgd,100,10,-5\n", r"row 2: must be positive: \{'average_power': -5.0\}"),
        ("d,n,8,sgd,100,10,50\nd,n,8,sgd,0,10,50\n", "row 3: must be positive"),
        ("d,n,8,sgd,100,10,50\nd,n,8,sgd,100,11,51\n", "row 3: duplicate of row 2"),
        ("d,n,8,sgd,100,ten,50\n", "row 2: .* must be numbers"),
        ("", "no rows"),
    ],
)
def test_bad_rows_name_file_row_and_problem(tmp_path: Path, body: str, expected: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ProfileError, match=expected) as info:
        PowerTrace.load(path)
    assert str(path) in str(info.value)


def test_missing_columns_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("dataset,network,batch_size\nd,n,8\n")
    with pytest.raises(ProfileError, match=r"missing columns.*optimizer"):
        PowerTrace.load(path)
    with pytest.raises(ProfileError, match="cannot read"):
        PowerTrace.load(tmp_path / "absent.csv")


def test_unknown_workload_lists_the_available_ones() -> None:
    with pytest.raises(
        ProfileError,
        match=r"no workload mnist/lenet batch 64; available: .*imagenet/resnet50 batch 128",
    ):
        SimulatedSpec(gpu="a40", workload="mnist/lenet", batch_size=64).model()
    with pytest.raises(ProfileError, match="no workload imagenet/resnet50 batch 7"):
        SimulatedSpec(gpu="a40", workload="imagenet/resnet50", batch_size=7).model()


def test_custom_csv_trace(tmp_path: Path) -> None:
    path = _write(tmp_path, "d,n,8,sgd,100,20,90\nd,n,8,sgd,200,10,180\n")
    spec = SimulatedSpec(gpu=str(path), steps_per_epoch=10)
    gpu = simulated_gpus(spec)[0]
    assert gpu.uuid == "GPU-sim-trace-0"
    assert gpu.name == "trace (simulated)"
    gpu.set_power_limit_w(150.0)
    assert gpu.run_step() == pytest.approx(1.5)
    gpu.set_power_limit_w(200.0)


def test_spec_reports_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        SimulatedSpec(gpu="a100", count=0, noise_std=-1, workload="x/y", slowdowns=(0.5,))
    problems = "\n".join(info.value.problems)
    for key in ("count: 0", "noise_std: -1", "workload: 'x/y'", "slowdowns: (0.5,)"):
        assert key in problems
