"""Command-line arguments: any number (NaN, infinities, huge, negative, tiny, not a number)
ends in exit 0 or in exit 2 with one message naming the argument, never a traceback; a
closed output pipe ends quietly."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_energy.cli.demo
import lightning_energy.cli.plan
from lightning_energy.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from lightning_energy.device.lease import LEASE_DIR_ENV
from lightning_energy.report import write_report
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, make_module
from tests.lightning_energy.test_report import _config, _run

_SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

#: Numbers as a user may type them, the rude ones first.
_NUMBERS = st.one_of(
    st.sampled_from(
        ["nan", "inf", "-inf", "1e9", "1e308", "1e-9", "1e-300", "-1", "0", "-0", "2**64", ""]
    ),
    st.sampled_from([str(2**64), str(10**400), "18446744073709551615", "1_000", " 5 ", "x"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers().map(str),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
)


def _tiny_profile(data_dir: Path, path: Path, clocks_mhz: set[str] | None = None) -> Path:
    """Stages 0 and 1 of the 4-stage profile (at the given clocks)."""
    with open(data_dir / "perseus_profiles" / "profile_S4_M8.csv", newline="") as source:
        rows = [
            row
            for row in csv.DictReader(source)
            if row["stage"] in {"0", "1"} and (clocks_mhz is None or row["frequency"] in clocks_mhz)
        ]
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _check(code: int, err: str, option: str) -> None:
    assert code in (EXIT_OK, EXIT_USAGE), err
    assert "Traceback" not in err
    if code == EXIT_USAGE:
        assert option in err and "error:" in err, err


@pytest.mark.parametrize(
    "option",
    [
        "--microbatches",
        "--virtual-stages",
        "--p2p-power-w",
        "--target-time",
        "--time-step-s",
        "--rows",
    ],
)
@_SETTINGS
@given(value=_NUMBERS)
def test_plan_numbers_are_accepted_in_range_or_refused(
    option: str,
    value: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: dict[str, Any] = {}

    def record(args: argparse.Namespace) -> int:
        seen["args"] = args
        return EXIT_OK

    # Planning itself takes seconds; what is checked here is what reaches it.
    monkeypatch.setattr(lightning_energy.cli.plan, "run", record)
    argv = ["plan", "--profile", "p.csv", "--microbatches", "4", f"{option}={value}"]
    code = main(argv)
    _check(code, capsys.readouterr().err, option)
    if code == EXIT_OK:
        number = float(getattr(seen["args"], option.lstrip("-").replace("-", "_")))
        assert math.isfinite(number) and number >= 0


@_SETTINGS
@given(value=_NUMBERS)
def test_demo_seed_is_accepted_in_range_or_refused(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def record(args: argparse.Namespace) -> int:
        seen["args"] = args
        return EXIT_OK

    monkeypatch.setattr(lightning_energy.cli.demo, "run", record)
    code = main(["demo", f"--seed={value}", f"--steps={value}"])
    err = capsys.readouterr().err
    _check(code, err, "--s")
    if code == EXIT_OK:
        assert 0 <= seen["args"].seed < 2**32 and seen["args"].steps >= 1


@_SETTINGS
@given(value=_NUMBERS)
def test_carbon_forecast_hours_run_or_are_refused(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "carbon.yaml"
    path.write_text("carbon:\n  provider: constant\n", encoding="utf-8")
    code = main(["carbon", "forecast", "--config", str(path), "--json", f"--hours={value}"])
    captured = capsys.readouterr()
    _check(code, captured.err, "--hours")
    if code == EXIT_OK:
        assert 0 < float(value) <= 8760 and isinstance(json.loads(captured.out), dict)


@_SETTINGS
@given(value=_NUMBERS)
def test_doctor_timeout_runs_or_is_refused(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = make_module([])
    module.init_error = ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", module)
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))
    monkeypatch.delenv("LIGHTNING_ENERGY_CONFIG", raising=False)
    code = main(["doctor", f"--timeout={value}"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == EXIT_USAGE:
        assert "--timeout" in err
    else:
        assert 0 < float(value) <= 600 and code in (EXIT_OK, EXIT_FAILURE)


def test_recover_refuses_an_empty_lease_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.json").write_text("{}")
    assert main(["recover", "--lease-dir", ""]) == EXIT_USAGE
    assert "--lease-dir: '' is not allowed" in capsys.readouterr().err
    assert (tmp_path / "stray.json").read_text() == "{}"


def test_report_refuses_an_empty_plot_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["report", "run.json", "--out", ""]) == EXIT_USAGE
    assert "--out: '' is not allowed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_plan_refuses_a_grid_too_fine_to_compute(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _tiny_profile(data_dir, tmp_path / "small.csv")  # every clock: not exact
    out = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile), "--microbatches", "3", "--output", str(out)]
    assert main([*argv, "--time-step-s", "1e-9"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--time-step-s=1e-09" in err and "at most 10000 iteration times" in err
    assert not out.exists()


@pytest.mark.parametrize("output", ["/proc/x", "{tmp}"])
def test_plan_refuses_an_output_it_cannot_write(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    profile = _tiny_profile(data_dir, tmp_path / "tiny.csv", {"1410", "1200", "990", "800"})
    argv = ["plan", "--profile", str(profile), "--microbatches", "3", "--no-progress"]
    assert main([*argv, "--output", output.format(tmp=tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--output" in err and "Traceback" not in err


class _ClosedPipe(io.StringIO):
    """stdout after its reader (``head``) went away."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_report_json_into_a_closed_pipe_ends_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_report(_run(_config(tmp_path), steps=20), tmp_path / "run.json")
    capsys.readouterr()
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["report", str(path), "--json"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "closed" in err and "Traceback" not in err


def test_plan_json_into_a_closed_pipe_ends_quietly(
    data_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    profile = _tiny_profile(data_dir, tmp_path / "tiny.csv", {"1410", "1200", "990", "800"})
    out = tmp_path / "plan.json"
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    argv = ["plan", "--profile", str(profile), "--microbatches", "3", "--output", str(out)]
    assert main([*argv, "--json"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "closed" in err
    assert json.loads(out.read_text())  # the plan itself was written before the summary
