"""``lightning-energy carbon now|forecast``: output, --json, exit codes, no token in logs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_energy.cli import main
from tests.carbon.conftest import ApiServer, Reply

TOKEN = "cli-tok-PLANTED-e3a9"


@pytest.fixture(autouse=True)
def _restore_root_level() -> Iterator[None]:
    """``--verbose`` lowers the root logger's level; put it back."""
    root = logging.getLogger()
    level = root.level
    urllib3_level = logging.getLogger("urllib3").level
    yield
    root.setLevel(level)
    logging.getLogger("urllib3").setLevel(urllib3_level)


def config(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text("carbon:\n" + body, encoding="utf-8")
    return str(path)


@pytest.mark.wall_clock  # `carbon now` reads a trace at today's date; any date gives these fields
def test_now_from_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "  provider: trace\n  region: FR\n")
    assert main(["carbon", "now", "--config", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace FR: ") and "gCO2eq/kWh" in out
    assert "replayed from a recorded trace" in out and "measured" not in out.split("not")[0]
    assert main(["carbon", "now", "--config", path, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["provider"] == "trace" and body["region"] == "FR"
    assert isinstance(body["g_per_kwh"], float) and body["g_per_kwh"] > 0
    assert body["kind"] == "measured" and body["source"] == "trace:FR"
    assert body["replayed"] is True


def test_now_constant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "  provider: constant\n  constant_g_per_kwh: 123.5\n")
    assert main(["carbon", "now", "--config", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["g_per_kwh"] == 123.5
    assert main(["carbon", "now", "--config", path]) == 0
    out = capsys.readouterr().out
    assert (
        out == "constant: 123.5 gCO2eq/kWh (a fixed value from the configuration, not grid data)\n"
    )


@pytest.mark.wall_clock  # 5 hours ahead from now: 5 or 6 rows at any date and time of day
def test_forecast_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "  provider: trace\n  region: CISO\n")
    assert main(["carbon", "forecast", "--config", path, "--hours", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["time", "(UTC)", "gCO2eq/kWh", "kind"]
    rows = lines[2:]
    assert len(rows) in (5, 6) and all(r.endswith("replayed") for r in rows)
    assert main(["carbon", "forecast", "--config", path, "--hours", "5", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["points"]) == len(rows)
    assert {p["kind"] for p in body["points"]} == {"forecast"}
    assert all(isinstance(p["g_per_kwh"], float) for p in body["points"])


def test_electricitymaps_via_local_server_never_logs_the_token(
    tmp_path: Path,
    api_server: ApiServer,
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("EM_TOKEN_FOR_TEST", TOKEN)
    recorded = data_dir / "carbon_api" / "electricitymaps"
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(recorded / "em_v3_latest_US-MIDW-MISO_direct.json"),
    )
    path = config(
        tmp_path,
        "  provider: electricitymaps\n  region: US-MIDW-MISO\n  token_env: EM_TOKEN_FOR_TEST\n"
        f"  base_url: {api_server.url}/v3\n",
    )
    caplog.set_level(logging.DEBUG)
    code = main(["carbon", "now", "--config", path, "--json", "--verbose"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    body = json.loads(captured.out)
    assert body["g_per_kwh"] == 506.0 and body["emission_factor"] == "direct"
    assert main(["carbon", "now", "--config", path]) == 0
    assert capsys.readouterr().out.startswith(
        "electricitymaps US-MIDW-MISO (direct emission factors): 506.0 gCO2eq/kWh"
    )
    assert any(r.name.startswith("urllib3") for r in caplog.records)  # DEBUG was on
    assert logging.getLogger().level == logging.DEBUG
    everything = captured.out + captured.err + "\n".join(r.getMessage() for r in caplog.records)
    assert TOKEN not in everything
    assert api_server.seen[0].headers["auth-token"] == TOKEN


def test_provider_failure_exits_1(
    tmp_path: Path,
    api_server: ApiServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("EM_TOKEN_FOR_TEST", TOKEN)
    api_server.route("/v3/carbon-intensity/latest", Reply.json({"error": "bad token"}, 401))
    path = config(
        tmp_path,
        "  provider: electricitymaps\n  region: DE\n  token_env: EM_TOKEN_FOR_TEST\n"
        f"  base_url: {api_server.url}/v3\n",
    )
    assert main(["carbon", "now", "--config", path]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: electricitymaps: the token was rejected") and TOKEN not in err


def test_configuration_problems_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MISSING_TOKEN_VAR", raising=False)
    path = config(
        tmp_path,
        "  provider: electricitymaps\n  region: de\n  token_env: MISSING_TOKEN_VAR\n"
        "  poll_interval_s: -1\n",
    )
    assert main(["carbon", "now", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err and "MISSING_TOKEN_VAR" in err and "region: 'de'" in err
    assert main(["carbon", "now", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_bad_usage_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "  provider: constant\n")
    assert main(["carbon", "now"]) == 2  # --config is required
    assert main(["carbon"]) == 2  # an action is required
    for hours in ("0", "-1", "nan", "inf", "1e9"):
        assert main(["carbon", "forecast", "--config", path, "--hours", hours]) == 2
        assert f"--hours: '{hours}' is not allowed; use a number > 0 and <= 8760" in (
            capsys.readouterr().err
        )


def test_verbose_5xx_with_an_echoed_token_shows_no_prefix_of_it(
    tmp_path: Path,
    api_server: ApiServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain-text 502 page quoting the token where the excerpt is cut."""
    monkeypatch.setenv("EM_TOKEN_FOR_TEST", TOKEN)
    body = ("Bad gateway. " * 15)[:190] + TOKEN + " upstream said no" * 20
    api_server.route(
        "/v3/carbon-intensity/latest", Reply(502, body.encode(), {"Content-Type": "text/plain"})
    )
    path = config(
        tmp_path,
        "  provider: electricitymaps\n  region: DE\n  token_env: EM_TOKEN_FOR_TEST\n"
        f"  base_url: http://user:proxy-PW-PLANTED@{api_server.url.split('//')[1]}/v3\n",
    )
    caplog.set_level(logging.DEBUG)
    assert main(["carbon", "now", "--config", path, "--verbose"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: electricitymaps: server error: Bad gateway.")
    everything = captured.out + captured.err + "\n".join(r.getMessage() for r in caplog.records)
    assert TOKEN[:6] not in everything and "proxy-PW" not in everything
