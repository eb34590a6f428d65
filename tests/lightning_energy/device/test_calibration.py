"""A calibration JSON as a simulated GPU: the model it builds, and clear errors for every
kind of bad file."""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_energy.config import EnergyConfig
from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.simulated import CALIBRATION_FORMAT, load_calibration
from lightning_energy.errors import ConfigError

VALID: dict[str, Any] = {
    "format": CALIBRATION_FORMAT,
    "gpu": {"name": "NVIDIA Test GPU", "uuid": "GPU-0000"},
    "counter": {"period_s": 0.1},
    "idle_power_w": 60.0,
    "limits": {
        "min_power_limit_w": 100.0,
        "default_power_limit_w": 300.0,
        "max_power_limit_w": 300.0,
    },
    "clocks": {"supported_sm_clocks_mhz": [1400, 1300, 1200, 1100, 1000, 900, 800]},
    "power_limit_sweep": [
        {"power_limit_w": 300.0, "sm_clock_mhz": 1400, "time_per_step_s": 0.2, "power_w": 280.0}
    ],
    "clock_sweep": [
        {
            "locked_sm_clock_mhz": 1000,
            "sm_clock_mhz": 1000,
            "time_per_step_s": 0.26,
            "power_w": 180.0,
        }
    ],
    "power_readings": {"instant_power_available": True},
    "setting_latency_s": {"set_power_limit_s": 0.05, "set_locked_clocks_s": 0.07},
}


def _write(directory: Path, document: Any) -> Path:
    path = directory / "calibration.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def test_valid_file_builds_the_measured_gpu(tmp_path: Path) -> None:
    calibration = load_calibration(_write(tmp_path, VALID))
    model = calibration.model
    assert calibration.energy_counter_period_s == 0.1
    assert calibration.setting_latency_s == 0.07
    assert model.name == "NVIDIA Test GPU (calibrated)"
    # t(1000) / t(1400) = 1.3 = beta * 1400 / 1000 + 1 - beta: beta = 0.75.
    assert model.step_compute_bound_share == pytest.approx(0.75)
    assert model.step_time_s == pytest.approx(0.2)
    assert model.power_w(1200) == pytest.approx(230.0)  # between the measured clocks
    assert model.power_w(800) == pytest.approx(130.0)  # along the lower segment
    # A 200 W limit caps the clock at the highest one drawing at most 200 W.
    assert model.clock_for(0.75, 200.0) == 1000
    assert model.clock_for(0.75, 300.0, max_clock_mhz=1100) == 1100
    assert model.clock_for(0.75, 50.0) == 800  # none fits: the lowest clock


def test_simulated_gpu_from_config_runs_as_measured(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID)
    config = EnergyConfig.from_mapping(
        {"device": {"backend": "simulated", "calibration": str(path)}}
    )
    spec = config.device.simulated_spec()
    assert spec.label == "calibration"
    board = spec.board()
    assert (board.energy_counter_period_s, board.power_average_s, board.setting_latency_s) == (
        0.1,
        1.0,
        0.07,
    )
    (gpu,) = simulated_gpus(spec)
    assert gpu.name == "NVIDIA Test GPU (calibrated) (simulated)"
    assert gpu.power_limit_constraints_w() == (100.0, 300.0)
    assert gpu.run_step() == pytest.approx(0.2)
    gpu.set_locked_clocks_mhz(1000, 1000)
    try:
        gpu.idle(1.0)
        assert gpu.run_step() == pytest.approx(0.26)
        assert gpu.sm_clock_mhz() == 1000
        assert gpu.instant_power_w() == pytest.approx(180.0)
    finally:
        gpu.reset_locked_clocks()


def test_step_parameters_replace_the_measured_ones(tmp_path: Path) -> None:
    path = str(_write(tmp_path, VALID))
    model = SimulatedSpec(calibration=path, step_time_s=0.5, compute_bound_share=0.5).model()
    assert model.step_work() == (0.5, 0.5)
    with pytest.raises(ConfigError, match=r"workload: .* is not allowed; it only applies to trace"):
        SimulatedSpec(calibration=path, workload="imagenet/resnet50")


def test_missing_file_is_named_in_the_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping({"device": {"backend": "simulated", "calibration": str(missing)}})
    (problem,) = info.value.problems
    assert problem.startswith("device.calibration")
    assert str(missing) in problem and "no such file" in problem
    assert "benchmarks/gpu/calibrate.py" in problem


def _set(document: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    bad = copy.deepcopy(document)
    target: Any = bad
    for key in path[:-1]:
        target = target[key]
    if value is _MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return bad


def _name(path: tuple[str | int, ...]) -> str:
    return "".join(
        f"[{k}]" if isinstance(k, int) else (f".{k}" if i else k) for i, k in enumerate(path)
    )


_MISSING = object()
_NOT_NUMBERS = [_MISSING, None, "fast", True, [], {}, -1.0, math.inf, math.nan, 10**400, -(10**400)]
# Each field, and values it must refuse.
_FIELDS: list[tuple[tuple[str | int, ...], list[Any]]] = [
    (("counter", "period_s"), _NOT_NUMBERS),
    (("idle_power_w",), [*_NOT_NUMBERS, 0]),
    (("limits", "min_power_limit_w"), [*_NOT_NUMBERS, 0]),
    (("limits", "default_power_limit_w"), [*_NOT_NUMBERS, 0]),
    (("limits", "max_power_limit_w"), [*_NOT_NUMBERS, 0]),
    (("power_limit_sweep", 0, "sm_clock_mhz"), [*_NOT_NUMBERS, 0]),
    (("clock_sweep", 0, "time_per_step_s"), [*_NOT_NUMBERS, 0]),
    (("clock_sweep", 0, "power_w"), [*_NOT_NUMBERS, 0]),
    (
        ("clocks", "supported_sm_clocks_mhz"),
        [_MISSING, None, "many", [], [0], ["1400"], [1.5], {}, [10**400], [1400, -(10**400)]],
    ),
    (("gpu", "name"), [_MISSING, None, "", "  ", 3]),
    (("gpu",), [_MISSING, None, "H200", [], 3]),
    (("counter",), [_MISSING, None, 0.1, []]),
    (("limits",), [_MISSING, None, "700 W"]),
    (("clocks",), [_MISSING, None, [1400]]),
    (("clock_sweep",), ["rows", 3, {}]),
    (("clock_sweep", 0), [None, "row", 1]),
]


@st.composite
def _bad_field(draw: st.DrawFn) -> tuple[tuple[str | int, ...], Any]:
    path, values = draw(st.sampled_from(_FIELDS))
    return path, draw(st.sampled_from(values))


@given(bad=st.lists(_bad_field(), min_size=1, max_size=3, unique_by=lambda b: b[0][0]))
def test_bad_fields_are_each_named_with_what_is_allowed(
    bad: list[tuple[tuple[str | int, ...], Any]],
) -> None:
    document = VALID
    for path, value in bad:
        document = _set(document, path, value)
    with tempfile.TemporaryDirectory() as directory:
        path_written = _write(Path(directory), json.dumps(document))
        with pytest.raises(ConfigError) as info:
            load_calibration(path_written)
    problems = info.value.problems
    text = "\n".join(problems)
    for path, _ in bad:
        assert _name(path) in text, (_name(path), problems)
    for problem in problems:
        assert problem.startswith(f"calibration {str(path_written)!r}: ")
        assert "use " in problem, problem


@given(text=st.text(max_size=40))
def test_text_that_is_not_a_calibration_object(text: str) -> None:
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        expected = "not JSON"
    else:
        expected = "use a JSON object" if not isinstance(parsed, dict) else "format"
    with tempfile.TemporaryDirectory() as directory:
        path = _write(Path(directory), text)
        with pytest.raises(ConfigError) as info:
            load_calibration(path)
    (problem,) = info.value.problems
    assert expected in problem and "use " in problem


@given(fmt=st.one_of(st.none(), st.text(max_size=20), st.integers()))
def test_wrong_format_names_the_expected_one(fmt: Any) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = _write(Path(directory), {**VALID, "format": fmt})
        with pytest.raises(ConfigError, match=r"format .* is not allowed; use 'lightning-energy"):
            load_calibration(path)


def test_one_clock_only_is_not_enough(tmp_path: Path) -> None:
    document = {**VALID, "clock_sweep": []}
    with pytest.raises(ConfigError, match=r"1 usable row\(s\) at 1 clock\(s\) is not enough"):
        load_calibration(_write(tmp_path, document))


def test_limits_out_of_order(tmp_path: Path) -> None:
    document = _set(VALID, ("limits", "default_power_limit_w"), 400.0)
    with pytest.raises(ConfigError, match=r"use min <= default <= max"):
        load_calibration(_write(tmp_path, document))


@pytest.mark.parametrize("clock", [10**400, -(10**400)])
def test_a_clock_no_float_holds_is_named(tmp_path: Path, clock: int) -> None:
    document = _set(VALID, ("clocks", "supported_sm_clocks_mhz"), [1400, clock])
    with pytest.raises(ConfigError, match=r"clocks.supported_sm_clocks_mhz: .* is not allowed"):
        load_calibration(_write(tmp_path, document))
