"""Reading a report: any bytes, any JSON, any value in any field gives the table (and the
plots) or one ReportError naming what is wrong, never another exception."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_energy.cli import EXIT_OK, EXIT_USAGE, main
from lightning_energy.plots import render_plots
from lightning_energy.report import (
    ReportError,
    build_report,
    chosen_power_limits_w,
    format_report,
    load_report,
)
from tests.lightning_energy.test_report import _config, _run

_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10)
    | st.sampled_from([1e308, -1e308, 10**30, 10**400, "2023-06-01T00:00:00Z", [], {}]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def good_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("report")
    carbon = {"provider": "trace", "region": "FR", "policy": "forecast", "max_slowdown": 1.5}
    report: dict[str, Any] = json.loads(
        json.dumps(build_report(_run(_config(tmp, carbon), steps=60)))
    )
    return report


def _fields(report: dict[str, Any]) -> list[tuple[str, int | None, str]]:
    """Every (section, item index or None, key) of the fields in a report."""
    out: list[tuple[str, int | None, str]] = []
    for section, body in report.items():
        if isinstance(body, dict):
            out.extend((section, None, key) for key in body)
        elif isinstance(body, list) and body and isinstance(body[0], dict):
            out.extend((section, 0, key) for key in body[0])
    return out


def _read_and_render(path: Path) -> str:
    report = load_report(path)
    chosen_power_limits_w(report)
    return format_report(report)


@_SETTINGS
@given(data=st.data())
def test_any_value_in_any_field_is_read_or_refused(
    good_report: dict[str, Any], tmp_path: Path, data: st.DataObject
) -> None:
    section, index, key = data.draw(st.sampled_from(_fields(good_report)))
    report = copy.deepcopy(good_report)
    target = report[section] if index is None else report[section][index]
    target[key] = data.draw(_JSON)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    try:
        assert "steps" in _read_and_render(path)
    except ReportError as exc:
        assert str(path) in str(exc)


@_SETTINGS
@given(content=_JSON)
def test_any_json_document_is_read_or_refused(tmp_path: Path, content: Any) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(ReportError):
        _read_and_render(path)


@_SETTINGS
@given(blob=st.binary(max_size=100))
def test_any_bytes_are_refused(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "run.json"
    path.write_bytes(blob)
    with pytest.raises(ReportError):
        _read_and_render(path)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_plots_of_a_report_that_was_read_are_drawn(
    good_report: dict[str, Any], tmp_path: Path, data: st.DataObject
) -> None:
    section, index, key = data.draw(st.sampled_from(_fields(good_report)))
    report = copy.deepcopy(good_report)
    target = report[section] if index is None else report[section][index]
    target[key] = data.draw(_JSON)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    try:
        loaded = load_report(path)
    except ReportError:
        return
    assert len(render_plots(loaded, tmp_path / "plots")) == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"version": 1, \xff}', "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON report"),
        (b'{"version": ' + b"9" * 5000 + b"}", "not a JSON report"),
    ],
)
def test_unreadable_bytes_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "run.json"
    path.write_bytes(content)
    assert main(["report", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_wrong_inner_types_are_named(
    good_report: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = copy.deepcopy(good_report)
    report["summary"]["steps"] = "many"
    report["decisions"][0] = 7
    report["profile"][0]["energy_per_step_j"] = None
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == EXIT_USAGE
    err = capsys.readouterr().err
    for field in ("summary.steps", "decisions[0]", "profile[0].energy_per_step_j"):
        assert field in err
    assert not (tmp_path / "plots").exists()


def test_the_unchanged_report_is_read(good_report: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(good_report), encoding="utf-8")
    assert main(["report", str(path)]) == EXIT_OK


#: Summary fields the table shows, with the row that shows each.
_MEASURED_ROWS = {
    "steps": "steps",
    "energy_j": "energy",
    "duration_s": "time (device clock)",
    "energy_saved_j": "energy saved vs. full power",
    "slowdown": "slowdown vs. full power",
}


@_SETTINGS
@given(
    fields=st.sets(st.sampled_from(sorted(_MEASURED_ROWS)), min_size=1),
    absent=st.booleans(),
)
def test_a_value_the_report_lacks_is_shown_as_not_measured(
    good_report: dict[str, Any], tmp_path: Path, fields: set[str], absent: bool
) -> None:
    report = copy.deepcopy(good_report)
    for field in fields:
        if absent:
            del report["summary"][field]
        else:
            report["summary"][field] = None
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    rows = {
        name: value.strip()
        for name, value in (
            line.strip().split("  ", 1) for line in _read_and_render(path).splitlines()
        )
    }
    for field in fields:
        assert rows[_MEASURED_ROWS[field]] == "not measured", field
    if "energy_j" in fields:
        assert rows["energy saved vs. full power"] == "not measured"
