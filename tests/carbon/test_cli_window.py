"""``lightning-energy carbon window``: the best start, its grams, Slurm, and bad arguments."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from carbon.providers.trace import load_trace
from lightning_energy.cli import carbon as carbon_cli
from lightning_energy.cli import main
from tests.carbon.conftest import ApiServer, Reply

NOW = datetime(2023, 6, 1, 6, 10, tzinfo=timezone.utc)
TOKEN = "window-tok-PLANTED-41b7"
TRACE = ["--provider", "trace", "--region", "DE"]


@pytest.fixture(autouse=True)
def _fixed_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(carbon_cli, "_now", lambda: NOW)


def _window(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["carbon", "window", *args, "--json"]) == 0, capsys.readouterr().err
    body: dict = json.loads(capsys.readouterr().out)
    return body


def test_the_start_is_the_cleanest_of_the_trace_and_the_grams_are_those_of_the_power(
    capsys: pytest.CaptureFixture[str],
) -> None:
    body = _window(capsys, "--duration", "6h", "--within", "30h", *TRACE, "--power-w", "1500")
    assert (body["provider"], body["region"], body["emission_factor"]) == ("trace", "DE", "direct")
    # every start a whole planning step (15 min) from now, against the trace itself (the
    # trace's forecast is its own future, so the expected and the true grams agree)
    series = load_trace("DE")
    now_s, step_s = NOW.timestamp(), body["step_s"]
    starts = now_s + step_s * np.arange(int((30 - 6) * 3600 / step_s) + 1)
    grams = [series.integral_g_s_per_kwh(s, s + 6 * 3600.0) * 1500.0 / 3.6e6 for s in starts]
    best = int(np.argmin(grams))
    assert body["start"] == datetime.fromtimestamp(starts[best], tz=timezone.utc).isoformat()
    assert body["start_in_s"] == pytest.approx(best * step_s)
    assert body["emissions_g"] == pytest.approx(grams[best], rel=1e-9)
    assert body["now_emissions_g"] == pytest.approx(grams[0], rel=1e-9)
    assert body["saved_g"] == pytest.approx(grams[0] - grams[best], rel=1e-9)
    assert body["power_w"] == 1500.0 and body["power_from"] == "given"
    assert body["beyond_forecast_s"] == 0.0 and body["forecast_reach_s"] >= 72 * 3600.0
    start = datetime.fromisoformat(body["start"])
    assert body["slurm_begin"] == start.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


def test_the_table_for_people_says_when_what_and_how_to_submit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["carbon", "window", "--duration", "6h", "--within", "30h", *TRACE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0] == "trace DE (direct emission factors): the best start of a 6 h job done within 30 h"
    )
    assert out[1].startswith("  start      2023-06-0") and " UTC (in " in out[1]
    assert out[2].startswith("  expected   ") and "gCO2eq/kWh over the job, against" in out[2]
    assert out[3] == "  emissions  give --power-w or --report for the grams"
    assert out[4].startswith("  forecast   reaches 7") and "the job lies within it" in out[4]
    assert out[5].startswith("  slurm      sbatch --begin=2023-06-0")


def test_the_power_of_a_run_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = {
        "version": 1,
        "created": "2023-05-30T00:00:00+00:00",
        "config": {},
        "devices": [],
        "timeline": [],
        "profile": [],
        "decisions": [],
        "summary": {"energy_j": 3.0e6, "duration_s": 3600.0},
        "job": {"ranks": 4, "energy_j": 1.2e7},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    body = _window(capsys, "--duration", "2h", *TRACE, "--report", str(path))
    assert body["power_w"] == pytest.approx(1.2e7 / 3600.0)  # the whole job's energy
    assert body["power_from"] == f"measured in {path}"
    assert body["emissions_g"] == pytest.approx(body["mean_g_per_kwh"] * 1.2e7 / 3.6e6 * 2)
    unmeasured = {k: v for k, v in report.items() if k != "job"}
    path.write_text(json.dumps({**unmeasured, "summary": {"steps": 0}}), encoding="utf-8")
    assert main(["carbon", "window", "--duration", "2h", *TRACE, "--report", str(path)]) == 2
    assert "holds no measured energy and time" in capsys.readouterr().err
    missing = str(tmp_path / "none.json")
    assert main(["carbon", "window", "--duration", "2h", *TRACE, "--report", missing]) == 2
    assert "error: --report: " in capsys.readouterr().err


def test_the_power_of_a_paced_simulated_run_leaves_its_pauses_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The window plans a job that runs without a break: a carbon pause (a logging
    interval without a step, at idle power) is no part of the job's power, and a
    simulated GPU's power is said to be simulated."""
    # 200 W while training, 30 W while paused
    timeline = [
        {"step": 10, "time_s": 1000.0, "steps": 10, "duration_s": 1000.0, "energy_j": 2.0e5},
        {"step": 10, "time_s": 4000.0, "steps": 0, "duration_s": 3000.0, "energy_j": 9.0e4},
        {"step": 20, "time_s": 5000.0, "steps": 10, "duration_s": 1000.0, "energy_j": 2.0e5},
    ]
    report = {
        "version": 1,
        "created": "2023-05-30T00:00:00+00:00",
        "config": {},
        "devices": [{"index": 0, "name": "NVIDIA A40 (simulated)", "uuid": "GPU-sim-a40-0"}],
        "timeline": timeline,
        "profile": [],
        "decisions": [{"purpose": "pause", "kind": "power_limit", "value": 100.0}],
        "summary": {"energy_j": 4.9e5, "duration_s": 5000.0},
        "job": {"ranks": 2, "energy_j": 9.8e5},  # two such ranks
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    body = _window(capsys, "--duration", "2h", *TRACE, "--report", str(path))
    assert body["power_w"] == pytest.approx(400.0)  # 200 W training on each of 2 ranks
    assert "simulated" in body["power_from"] and "pauses left out" in body["power_from"]


def test_electricitymaps_without_a_forecast_in_the_plan_still_plans_and_says_so(
    tmp_path: Path,
    api_server: ApiServer,
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("EM_TOKEN_FOR_TEST", TOKEN)
    recorded = data_dir / "carbon_api" / "electricitymaps"
    api_server.route(
        "/v4/carbon-intensity/latest", Reply.file(recorded / "em_v4_latest_DK-DK2_direct.json")
    )
    api_server.route("/v4/carbon-intensity/forecast", Reply.json({"message": "no"}, 401))
    path = tmp_path / "job.yaml"
    path.write_text(
        "carbon:\n  provider: electricitymaps\n  region: DK-DK2\n  token_env: EM_TOKEN_FOR_TEST\n"
        f"  base_url: {api_server.url}/v4\n",
        encoding="utf-8",
    )
    code = main(["carbon", "window", "--duration", "3h", "--config", str(path), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "warning: no forecast" in captured.err and "plan does not include" in captured.err
    body = json.loads(captured.out)
    assert body["forecast_reach_s"] == 0.0 and body["start_in_s"] == 0.0  # nothing to go on
    assert TOKEN not in captured.out + captured.err
    # the latest value failing is a failure of the provider
    api_server.route("/v4/carbon-intensity/latest", Reply.json({"message": "no"}, 401))
    assert main(["carbon", "window", "--duration", "3h", "--config", str(path)]) == 1
    assert "token was rejected" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--duration", "8h", "--within", "6h", *TRACE],
            "--within 6 h is shorter than --duration 8 h",
        ),
        (["--duration", "8h", "--within", "200h", *TRACE], "allowed: from the duration to 168h"),
        (["--duration", "30s", *TRACE], "--duration 30 s is not allowed; allowed: at least 1 min"),
        (["--duration", "2025-01-01T00:00:00Z", *TRACE], "is a time; use a duration such as '8h'"),
        (["--duration", "soon", *TRACE], "argument --duration: 'soon' is not allowed"),
        (
            ["--duration", "8h", *TRACE, "--power-w", "-5"],
            "argument --power-w: '-5' is not allowed",
        ),
        (["--duration", "8h", "--config", "x.yaml", "--region", "DE"], "not allowed with argument"),
        (["--duration", "8h"], "one of the arguments --config --region is required"),
        (["--duration", "8h", "--region", "DE", "--provider", "constant"], "invalid choice"),
        (
            ["--duration", "8h", *TRACE, "--power-w", "5", "--report", "r.json"],
            "not allowed with argument",
        ),
    ],
)
def test_bad_arguments_name_what_is_allowed(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["carbon", "window", *args]) == 2
    assert message in capsys.readouterr().err


def test_provider_only_goes_with_region(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("carbon:\n  provider: trace\n  region: FR\n", encoding="utf-8")
    args = ["carbon", "window", "--duration", "2h", "--config", str(path), "--provider", "uk"]
    assert main(args) == 2
    assert "--provider goes with --region" in capsys.readouterr().err


_VALID_DURATIONS = st.one_of(
    st.builds(lambda n: f"{n}h", st.integers(1, 60)),
    st.builds(lambda n: f"{n}m", st.integers(1, 3000)),
    st.builds(lambda n: f"{n}s", st.integers(1, 200)),
    st.builds(lambda d, h: f"P{d}DT{h}H", st.integers(0, 3), st.integers(0, 23)),
)
_DURATIONS = st.one_of(
    _VALID_DURATIONS,
    _VALID_DURATIONS,
    st.sampled_from(["1.5h", "30s", "0h", "-3h", "nan", "", "1e9h", "2025-01-01T00:00:00Z"]),
    st.builds(lambda n, u: f"{n}{u}", st.integers(-5, 9000), st.sampled_from(["h", "m", "d"])),
    st.text(max_size=8),
)
_POWERS = st.one_of(
    st.floats(1.0, 1e6).map(repr),
    st.floats(1.0, 1e6).map(repr),
    st.sampled_from(["0", "-1", "nan", "inf", "1e8", "abc", ""]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(duration=_DURATIONS, within=_DURATIONS, power=_POWERS)
def test_any_arguments_give_a_window_or_a_clear_error(
    duration: str, within: str, power: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    args = ["carbon", "window", f"--duration={duration}", f"--within={within}", *TRACE]
    code = main([*args, f"--power-w={power}", "--json"])
    captured = capsys.readouterr()
    assert code in (0, 2), captured.err
    assert "Traceback" not in captured.err
    event(f"exit {code}")
    if code == 2:
        named = ("--duration", "--within", "--power-w", "duration", "within")
        assert "error" in captured.err and any(n in captured.err for n in named), captured.err
        assert any(w in captured.err for w in ("allowed", "use a", "is a time")), captured.err
        return
    body = json.loads(captured.out)
    assert body["duration_s"] <= body["within_s"] <= 168 * 3600.0
    assert 0.0 < body["power_w"] <= 1e7 and math.isfinite(body["emissions_g"])
    assert body["emissions_g"] <= body["now_emissions_g"] * (1 + 1e-9)
    start = datetime.fromisoformat(body["start"])
    assert NOW <= start <= NOW + timedelta(seconds=body["within_s"] - body["duration_s"] + 1)
