"""The zeusd client against a fake zeusd over a real socket: transports, every write
blocking, the error answers and their types, a daemon down or too slow, the token kept
secret, the environment it is configured from, and the fake's own faithfulness."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.device.zeusd_client import ZeusdAddress, ZeusdClient
from lightning_energy.errors import (
    ConfigError,
    DaemonUnreachableError,
    DriverError,
    NoPermissionError,
    NotSupportedError,
)
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, a100, make_module
from tests.lightning_energy.device.fake_zeusd import (
    JOB_SCOPES,
    SIGNING_KEY,
    Answer,
    FakeZeusd,
    issue_token,
)

TOKEN = issue_token(SIGNING_KEY, "alice", JOB_SCOPES)


@pytest.fixture
def nvml() -> FakeNVML:
    module = make_module([a100(0), a100(1)])
    module.require_root = True  # the test process is an ordinary user
    return module


@pytest.fixture(params=["unix", "tcp"])
def daemon(request: pytest.FixtureRequest, nvml: FakeNVML, tmp_path: Path) -> Any:
    socket_path = tmp_path / "zeusd.sock" if request.param == "unix" else None
    with FakeZeusd(nvml, socket_path=socket_path, signing_key=SIGNING_KEY) as fake:
        yield fake


def client(daemon: FakeZeusd, token: str | None = TOKEN, **kwargs: Any) -> ZeusdClient:
    return ZeusdClient(ZeusdAddress.parse(daemon.address), token=token, **kwargs)


def test_reads_and_writes_reach_the_driver(daemon: FakeZeusd, nvml: FakeNVML) -> None:
    zeusd = client(daemon)
    assert zeusd.power_limit_constraints_mw(1) == (100_000, 400_000)
    zeusd.set_power_limit_mw(1, 250_000, gpu_index=0)
    assert nvml.devices[1].limit_mw == 250_000 and nvml.devices[0].limit_mw == 400_000
    assert zeusd.power_limit_mw(1) == 250_000
    zeusd.set_gpu_locked_clocks_mhz(0, 1005, 1395, gpu_index=0)
    assert nvml.devices[0].locked == (1005, 1395)
    zeusd.reset_gpu_locked_clocks(0, gpu_index=0)
    assert nvml.devices[0].locked is None
    assert zeusd.energy_mj(0) == 123_456 and zeusd.power_mw(0) == 250_500
    writes = daemon.writes()
    assert [path for path, _ in writes] == [
        "/gpu/set_power_limit",
        "/gpu/set_gpu_locked_clocks",
        "/gpu/reset_gpu_locked_clocks",
    ]
    assert all(query["block"] == "true" for _, query in writes)  # never fire-and-forget
    assert {auth for *_, auth in daemon.requests} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("schema", "expected", "names", "pci"),
    [
        ("0.4", "0.4", [None, None], [None, None]),
        ("0.5", "0.5", ["NVIDIA A100-SXM4-40GB"] * 2, [None, None]),
        ("master", "pci", ["NVIDIA A100-SXM4-40GB"] * 2, ["0000:10:00.0", "0000:11:00.0"]),
    ],
)
def test_discover_reads_every_schema(
    nvml: FakeNVML, tmp_path: Path, schema: str, expected: str, names: list[Any], pci: list[Any]
) -> None:
    with FakeZeusd(nvml, socket_path=tmp_path / "z.sock", schema=schema) as fake:
        found = client(fake, token=None).discover()
    assert found.schema == expected
    assert [g.id for g in found.gpus] == [0, 1]
    assert [g.name for g in found.gpus] == names
    assert [g.pci_address for g in found.gpus] == pci
    assert found.api_groups == ("gpu-control", "gpu-read", "cpu-read")
    assert found.auth_required is False
    assert found.describe_schema().startswith("zeusd ")


def test_whoami_names_the_user_and_scopes(daemon: FakeZeusd) -> None:
    token = issue_token(SIGNING_KEY, "bob", ["gpu-read"], exp=4_000_000_000)
    me = client(daemon, token=token).whoami()
    assert (me.sub, me.scopes, me.exp) == ("bob", ("gpu-read",), 4_000_000_000)


@pytest.mark.parametrize(
    ("token", "said"),
    [
        (None, "Authentication required"),
        (issue_token(SIGNING_KEY, "alice", JOB_SCOPES, exp=1), "Token has expired"),
        (issue_token(b"another key", "alice", JOB_SCOPES), "Invalid token"),
    ],
)
def test_a_missing_or_bad_token_is_refused_and_nothing_changes(
    daemon: FakeZeusd, nvml: FakeNVML, token: str | None, said: str
) -> None:
    with pytest.raises(NoPermissionError, match=said) as info:
        client(daemon, token=token).set_power_limit_mw(0, 200_000, gpu_index=0)
    assert "401" in str(info.value) and "ZEUSD_TOKEN" in (info.value.fix or "")
    assert nvml.calls == []


def test_a_token_without_gpu_control_is_refused_with_the_scope_to_ask_for(
    daemon: FakeZeusd, nvml: FakeNVML
) -> None:
    reader = client(daemon, token=issue_token(SIGNING_KEY, "bob", ["gpu-read"]))
    assert reader.power_limit_mw(0) == 400_000  # reads are allowed
    with pytest.raises(NoPermissionError, match=r"403.*lacks required scope 'gpu-control'") as info:
        reader.set_power_limit_mw(0, 200_000, gpu_index=0)
    assert "gpu-control" in (info.value.fix or "")
    assert nvml.calls == []


def test_a_disabled_api_group_is_unsupported_before_any_token_check(
    nvml: FakeNVML, tmp_path: Path
) -> None:
    with (
        FakeZeusd(
            nvml, socket_path=tmp_path / "z.sock", signing_key=SIGNING_KEY, enable=["gpu-read"]
        ) as fake,
        pytest.raises(NotSupportedError, match=r"404.*'gpu-control' is not enabled"),
    ):
        client(fake, token=None).set_power_limit_mw(0, 200_000, gpu_index=0)
    assert nvml.calls == []


@pytest.mark.parametrize(
    ("code", "error", "status"),
    [
        ("NVML_ERROR_NOT_SUPPORTED", NotSupportedError, "400"),
        ("NVML_ERROR_NO_PERMISSION", NoPermissionError, "403"),  # the daemon is not root
        ("NVML_ERROR_UNKNOWN", DriverError, "500"),
    ],
)
def test_a_driver_error_on_the_daemon_side_is_typed(
    daemon: FakeZeusd, nvml: FakeNVML, code: str, error: type[Exception], status: str
) -> None:
    nvml.devices[1].errors["nvmlDeviceSetGpuLockedClocks"] = ERROR_CODES[code]
    with pytest.raises(error, match=f"{status}: GPU 1: NVML error") as info:
        client(daemon).set_gpu_locked_clocks_mhz(1, 1005, 1005, gpu_index=3)
    assert str(info.value).startswith("GPU 3: ")  # the job's index labels the error
    assert nvml.devices[1].locked is None


def test_a_gpu_the_daemon_lacks_is_a_request_error(daemon: FakeZeusd) -> None:
    with pytest.raises(DriverError, match="400: GPU index 7 does not exist") as info:
        client(daemon).set_power_limit_mw(7, 200_000, gpu_index=0)
    assert not isinstance(info.value, NotSupportedError)


def test_a_daemon_that_is_down_is_unreachable_and_nothing_was_sent(
    nvml: FakeNVML, tmp_path: Path
) -> None:
    fake = FakeZeusd(nvml, socket_path=tmp_path / "z.sock").start()
    zeusd = client(fake, token=None)
    fake.stop()
    with pytest.raises(DaemonUnreachableError, match=r"unix:.*z\.sock.*ZEUSD_SOCK_PATH") as info:
        zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
    assert info.value.maybe_applied is False
    fake.restart()  # back, with nothing of the GPUs lost
    try:
        zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
    finally:
        fake.stop()
    assert nvml.devices[0].limit_mw == 200_000


def test_a_change_that_never_connected_was_not_applied(tmp_path: Path) -> None:
    """Failing to connect (here: a daemon whose accept queue is full, or a socket path
    under a regular file) sends nothing, whatever the error: the guard must not take the
    change as possibly applied."""
    busy = tmp_path / "busy.sock"
    (tmp_path / "a-file").write_text("")
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first,
    ):
        server.bind(str(busy))
        server.listen(0)
        first.connect(str(busy))  # fills the queue: the next connection waits
        for where in (busy, tmp_path / "a-file" / "z.sock"):
            zeusd = ZeusdClient(ZeusdAddress(socket_path=str(where)), timeout_s=0.2)
            with pytest.raises(DaemonUnreachableError, match="cannot be reached") as info:
                zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
            assert info.value.maybe_applied is False, str(info.value)


def test_a_connection_dropped_after_the_request_may_have_applied_it(tmp_path: Path) -> None:
    path = tmp_path / "drops.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)

        def drop_after_the_request() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)  # the request arrived; the daemon dies before answering

        dropper = threading.Thread(target=drop_after_the_request, daemon=True)
        dropper.start()
        zeusd = ZeusdClient(ZeusdAddress(socket_path=str(path)))
        with pytest.raises(DaemonUnreachableError, match="dropped the connection") as info:
            zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
        dropper.join(timeout=60)
    assert info.value.maybe_applied is True and "may still be applied" in str(info.value)


def test_an_answer_too_late_is_unreachable_and_may_have_applied(
    daemon: FakeZeusd, nvml: FakeNVML
) -> None:
    zeusd = client(daemon, timeout_s=0.2)
    with daemon.hold():
        with pytest.raises(DaemonUnreachableError, match=r"did not answer .* within 0.2 s") as info:
            zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
        assert info.value.maybe_applied is True
        with pytest.raises(DaemonUnreachableError) as read:
            zeusd.power_limit_mw(0)
        assert read.value.maybe_applied is False  # a read changes nothing
    assert nvml.devices[0].limit_mw == 200_000  # the daemon did apply it


def test_the_token_is_never_shown(daemon: FakeZeusd, caplog: pytest.LogCaptureFixture) -> None:
    zeusd = client(daemon)
    assert TOKEN not in repr(zeusd) and "token=set" in repr(zeusd)
    # A daemon (or a proxy in front of it) that repeats the token it was sent.
    daemon.answers["/gpu/set_power_limit"] = Answer(
        500, json.dumps({"error": f"bad header Authorization: Bearer {TOKEN}"}).encode()
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(DriverError) as info:
        zeusd.set_power_limit_mw(0, 200_000, gpu_index=0)
    assert TOKEN not in str(info.value) and "Bearer ***" in str(info.value)
    assert caplog.records and all(TOKEN not in r.getMessage() for r in caplog.records)


def test_an_answer_too_big_is_refused(daemon: FakeZeusd) -> None:
    daemon.answers["/gpu/get_power_limit"] = Answer(200, b" " * (2 << 20))
    with pytest.raises(DriverError, match="more than 1048576 bytes"):
        client(daemon).power_limit_mw(0)


# ------------------------------------------------------------------ configuration
def test_the_environment_names_the_daemon() -> None:
    assert ZeusdClient.from_env({}) is None
    both = {"ZEUSD_SOCK_PATH": "/run/z.sock", "ZEUSD_HOST_PORT": "10.0.0.1:4938"}
    assert str(ZeusdClient.from_env(both).address) == "unix:/run/z.sock"  # type: ignore[union-attr]
    tcp = ZeusdClient.from_env({"ZEUSD_HOST_PORT": "[::1]:4938", "ZEUSD_TOKEN": TOKEN + "\n"})
    assert tcp is not None and str(tcp.address) == "tcp:::1:4938" and tcp.has_token


@pytest.mark.parametrize("empty", ["", " ", "\n"])
def test_an_empty_token_is_no_token_as_for_zeus(daemon: FakeZeusd, empty: str) -> None:
    """Zeus' own client sends no token when ``ZEUSD_TOKEN`` is empty: a job that works with
    Zeus works here too."""
    env = {**daemon.env(), "ZEUSD_TOKEN": empty}
    no_auth = ZeusdClient.from_env(env)
    assert no_auth is not None and not no_auth.has_token
    assert no_auth.discover().gpus  # and it is usable


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"ZEUSD_SOCK_PATH": " "}, "ZEUSD_SOCK_PATH"),
        ({"ZEUSD_HOST_PORT": "localhost"}, "ZEUSD_HOST_PORT"),
        ({"ZEUSD_HOST_PORT": "localhost:99999"}, "ZEUSD_HOST_PORT"),
        ({"ZEUSD_SOCK_PATH": "/z.sock", "ZEUSD_TOKEN": "abc def\r\nX-Evil: 1"}, "ZEUSD_TOKEN"),
    ],
)
def test_unusable_variables_are_a_clear_error(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        ZeusdClient.from_env(env)
    assert "abc def" not in str(info.value)  # a token is never repeated, even a bad one


@pytest.mark.parametrize("text", ["unix:relative.sock", "unix:", "tcp:host", "http://x:1", ""])
def test_an_address_is_unix_or_tcp(text: str) -> None:
    with pytest.raises(ValueError):
        ZeusdAddress.parse(text)
    for good in ("unix:/run/zeusd/zeusd.sock", "tcp:127.0.0.1:4938"):
        assert str(ZeusdAddress.parse(good)) == good


# ------------------------------------------------------------------ the fake itself
def _raw(fake: FakeZeusd, method: str, target: str) -> tuple[int, str, bytes]:
    assert fake.socket_path is None
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=10)
    try:
        conn.request(method, target)
        answer = conn.getresponse()
        return answer.status, answer.getheader("Content-Type") or "", answer.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("target", "status", "kind", "said"),
    [
        (
            "/gpu/set_power_limit?gpu_ids=0&power_limit_mw=1&block=true&x=1",
            400,
            "text",
            b"unknown field `x`",
        ),
        ("/gpu/set_power_limit?gpu_ids=0&power_limit_mw=1", 400, "text", b"missing field `block`"),
        (
            "/gpu/set_power_limit?gpu_ids=0&power_limit_mw=1&block=yes",
            400,
            "text",
            b"`true` or `false`",
        ),
        ("/gpu/set_power_limit?gpu_ids=&power_limit_mw=1&block=true", 400, "json", b"at least one"),
        ("/gpu/get_power_limit?gpu_ids=9", 400, "json", b"GPU 9 not found"),
        ("/gpu/reset_locked_clocks?gpu_ids=0&block=true", 200, "text", b""),
    ],
)
def test_the_fake_rejects_requests_as_zeusd_does(
    nvml: FakeNVML, target: str, status: int, kind: str, said: bytes
) -> None:
    with FakeZeusd(nvml) as fake:
        got, content_type, body = _raw(
            fake, "POST" if "/set_" in target or "reset" in target else "GET", target
        )
    assert got == status and kind in content_type and said in body


def test_the_fake_runs_each_gpus_commands_in_arrival_order(nvml: FakeNVML) -> None:
    nvml.devices[0].errors["nvmlDeviceSetGpuLockedClocks"] = ERROR_CODES["NVML_ERROR_UNKNOWN"]
    with FakeZeusd(nvml) as fake:
        for limit_w in (300, 250, 200):
            status, _, _ = _raw(
                fake,
                "POST",
                f"/gpu/set_power_limit?gpu_ids=0,1&power_limit_mw={limit_w * 1000}&block=false",
            )
            assert status == 200  # at once, whatever happens next
        status, _, _ = _raw(
            fake,
            "POST",
            "/gpu/set_gpu_locked_clocks?gpu_ids=0&min_clock_mhz=1&max_clock_mhz=2&block=false",
        )
        assert status == 200  # the driver's failure is only logged
        _, _, body = _raw(fake, "GET", "/gpu/get_power_limit")
    assert json.loads(body) == {"0": {"power_limit_mw": 200_000}, "1": {"power_limit_mw": 200_000}}
    assert [gpu for gpu, _ in fake.log] == [0]


def test_the_fake_closes_what_it_opened(nvml: FakeNVML, tmp_path: Path) -> None:
    path = tmp_path / "z.sock"
    with FakeZeusd(nvml, socket_path=path):
        assert path.exists()
    assert not path.exists()
    with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
