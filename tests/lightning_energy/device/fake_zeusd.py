"""A fake zeusd: a real HTTP server, as the daemon answers, over the in-memory pynvml.

:class:`FakeZeusd` listens on a Unix socket or on loopback TCP (standard library servers,
one thread per request) and serves zeusd's GPU routes, ``/discover``, ``/time`` and
``/auth/whoami`` as zeusd 0.5.0 and its master branch do (routes, middleware order and
answers read from ``zeusd/src``): every parameter a query parameter, also on ``POST``;
unknown or missing parameters and bad booleans or numbers are a plain-text 400 (actix's
``Query deserialize error``); an empty or unparsable ``gpu_ids`` a JSON 400; a write to a
GPU index that does not exist a plain-text 400. Each GPU has one worker thread running its
commands in arrival order; ``block=true`` answers once every listed GPU's command ran
(per-GPU driver errors as ``{"errors": {"<id>": "..."}}`` with the worst status: no
permission 403, invalid argument or not supported 400, else 500), ``block=false`` answers
200 at once and only records failures in :attr:`FakeZeusd.log`.

Commands run on the fake pynvml module given, as root (:meth:`FakeNVML.as_root`), so what
the daemon sets is what NVML reads, and the test process itself may be unprivileged
(``require_root``). The daemon holds no state of its own: :meth:`FakeZeusd.stop` (the
daemon down) and :meth:`FakeZeusd.restart` lose nothing of the GPUs'.

Authentication as zeusd's middleware does it: a path whose API group is not enabled is a
JSON 404 before anything else; with a signing key, every path but ``/discover`` and
``/time`` needs ``Authorization: Bearer <HS256 JWT>`` (401 with
``WWW-Authenticate: Bearer realm="zeusd"`` when missing, invalid or expired: ``exp`` with
jsonwebtoken's 60 s leeway, on the fake's ``now_s`` clock), then the path's scope (403).
:func:`issue_token` issues tokens as ``zeusd token issue`` does.

Faults besides stopping: :meth:`FakeZeusd.hold` makes every answer wait (after the
command ran) until :meth:`FakeZeusd.release`, a daemon that answers too late;
:attr:`FakeZeusd.answers` replaces the answer of a path with any status and bytes.

Not served: ``/gpu/stream_power`` (server-sent events) and ``/cpu/*`` (RAPL), which this
package does not use.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import queue
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from lightning_energy.device import zeusd
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, make_module

ALL_GROUPS = ("gpu-control", "gpu-read", "cpu-read")
#: ``/discover`` as zeusd 0.4, 0.5.0 and master answer it.
SCHEMAS = ("0.4", "0.5", "master")
_LEEWAY_S = 60  # jsonwebtoken's default
_READ_FIELDS = frozenset({"gpu_ids"})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(
    key: bytes, sub: str, scopes: Sequence[str], exp: int | None = None, *, alg: str = "HS256"
) -> str:
    """A token as ``zeusd token issue --user SUB --scope ... --expires ...`` prints it."""
    claims: dict[str, Any] = {"sub": sub, "scopes": list(scopes)}
    if exp is not None:
        claims["exp"] = exp
    header = _b64(json.dumps({"typ": "JWT", "alg": alg}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = hmac.new(key, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64(signature)}"


@dataclass
class Answer:
    """What the server sends back."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def _json(status: int, data: Any) -> Answer:
    return Answer(status, json.dumps(data).encode())


def _text(status: int, text: str) -> Answer:
    return Answer(status, text.encode(), "text/plain; charset=utf-8")


class _Rejected(Exception):
    """A request answered with ``answer`` before it reaches a GPU."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


# What each route takes (besides gpu_ids and block on writes), with the NVML call it makes.
_WRITES: dict[str, tuple[str, ...]] = {
    "/gpu/set_persistence_mode": ("enabled",),
    "/gpu/set_power_limit": ("power_limit_mw",),
    "/gpu/set_gpu_locked_clocks": ("min_clock_mhz", "max_clock_mhz"),
    "/gpu/reset_gpu_locked_clocks": (),
    "/gpu/set_mem_locked_clocks": ("min_clock_mhz", "max_clock_mhz"),
    "/gpu/reset_mem_locked_clocks": (),
    "/gpu/reset_locked_clocks": (),  # master only
}
_READS = (
    "/gpu/get_cumulative_energy",
    "/gpu/get_power_limit",
    "/gpu/get_power_limit_constraints",
    "/gpu/get_persistence_mode",
    "/gpu/get_power",
)


def _required_scope(path: str) -> str | None:
    if path in ("/discover", "/time"):
        return None
    if path.startswith(("/gpu/set_", "/gpu/reset_")):
        return "gpu-control"
    if path.startswith("/gpu/"):
        return "gpu-read"
    if path.startswith("/cpu/"):
        return "cpu-read"
    return None


class FakeZeusd:
    """A zeusd serving the GPUs of a fake pynvml module.

    Args:
        nvml: the fake pynvml module (the GPUs, in NVML's order).
        socket_path: listen on this Unix socket; None: on loopback TCP (a free port).
        signing_key: require tokens signed with it (None: no authentication).
        enable: the API groups enabled (``--enable``).
        schema: the ``/discover`` answer: ``"0.4"``, ``"0.5"`` or ``"master"``.
        now_s: the clock tokens' ``exp`` is checked against.
    """

    def __init__(
        self,
        nvml: FakeNVML,
        *,
        socket_path: Path | None = None,
        signing_key: bytes | None = None,
        enable: Sequence[str] = ALL_GROUPS,
        schema: str = "master",
        now_s: Callable[[], float] = time.time,
    ) -> None:
        assert schema in SCHEMAS, schema
        self.nvml = nvml
        self.socket_path = socket_path
        self.signing_key = signing_key
        self.enable = tuple(enable)
        self.schema = schema
        self.now_s = now_s
        self.port: int | None = None
        #: Every request: (method, path, query, Authorization header or None).
        self.requests: list[tuple[str, str, dict[str, str], str | None]] = []
        #: What a non-blocking command that failed logged: (gpu id, message).
        self.log: list[tuple[int, str]] = []
        #: Answers that replace a path's (a daemon answering badly).
        self.answers: dict[str, Answer] = {}
        self._released = threading.Event()
        self._released.set()
        self._server: socketserver.BaseServer | None = None
        self._serving: threading.Thread | None = None
        self._queues: list[queue.Queue[Any]] = []
        self._workers: list[threading.Thread] = []
        self._names: list[str] = []
        self._pci: list[str] = []
        self._energy_ok: list[bool] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeZeusd:
        """Start serving (the daemon's start-up reads each GPU's name and PCI address)."""
        self.nvml.nvmlInit()  # the daemon's own initialisation, released by stop()
        with self.nvml.as_root():
            handles = [
                self.nvml.nvmlDeviceGetHandleByIndex(i)
                for i in range(self.nvml.nvmlDeviceGetCount())
            ]
            self._names = [self.nvml.nvmlDeviceGetName(h) for h in handles]
            self._pci = [self._pci_address(h) for h in handles]
            self._energy_ok = [h.energy_mj is not None for h in handles]
        self._queues = [queue.Queue() for _ in handles]
        self._workers = [
            threading.Thread(target=self._work, args=(q,), name=f"fake-zeusd-gpu-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for worker in self._workers:
            worker.start()
        handler = _handler(self)
        server: socketserver.BaseServer
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            server = _UnixHTTPServer(str(self.socket_path), handler)
        else:
            server = ThreadingHTTPServer(("127.0.0.1", self.port or 0), handler)
            server.daemon_threads = True
            self.port = server.server_address[1]
        self._server = server
        self._serving = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},  # how soon stop() is noticed
            name="fake-zeusd-server",
            daemon=True,
        )
        self._serving.start()
        return self

    def stop(self) -> None:
        """The daemon goes down: nothing listens any more (the GPUs keep their state)."""
        self._released.set()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._serving is not None:
            self._serving.join()
            self._serving = None
        for q in self._queues:
            q.put(None)
        for worker in self._workers:
            worker.join()
        if self._workers:
            self.nvml.nvmlShutdown()
        self._workers = []
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    def restart(self) -> None:
        """Stop and start again at the same address."""
        self.stop()
        self.start()

    def __enter__(self) -> FakeZeusd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``unix:<path>`` or ``tcp:127.0.0.1:<port>``, as a lease records it."""
        if self.socket_path is not None:
            return f"unix:{self.socket_path}"
        return f"tcp:127.0.0.1:{self.port}"

    def env(self, token: str | None = None) -> dict[str, str]:
        """The environment a client of this daemon is given."""
        if self.socket_path is not None:
            env = {"ZEUSD_SOCK_PATH": str(self.socket_path)}
        else:
            env = {"ZEUSD_HOST_PORT": f"127.0.0.1:{self.port}"}
        if token is not None:
            env["ZEUSD_TOKEN"] = token
        return env

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Answers wait, after their command ran, until the block ends (a daemon that
        answers too late)."""
        self._released.clear()
        try:
            yield
        finally:
            self._released.set()

    def writes(self) -> list[tuple[str, dict[str, str]]]:
        """The POST requests so far: (path, query)."""
        return [(path, query) for method, path, query, _ in self.requests if method == "POST"]

    # ------------------------------------------------------------------ requests
    def answer(self, method: str, target: str, authorization: str | None) -> Answer:
        """The answer to one request (middleware, then the route)."""
        split = urlsplit(target)
        path = split.path
        pairs = parse_qsl(split.query, keep_blank_values=True)
        query = dict(pairs)
        self.requests.append((method, path, query, authorization))
        try:
            self._authorize(path, authorization)
            if path in self.answers:
                return self.answers[path]
            if len(query) != len(pairs):
                duplicate = next(k for k in query if [p[0] for p in pairs].count(k) > 1)
                return _text(400, f"Query deserialize error: duplicate field `{duplicate}`")
            return self._route(method, path, query, authorization)
        except _Rejected as rejected:
            return rejected.answer

    def _authorize(self, path: str, authorization: str | None) -> None:
        scope = _required_scope(path)
        if scope is not None and scope not in self.enable:
            raise _Rejected(
                _json(404, {"error": f"API group '{scope}' is not enabled on this server."})
            )
        if self.signing_key is None:
            if path.startswith("/auth/"):
                raise _Rejected(
                    _json(404, {"error": "Authentication is not enabled on this server."})
                )
            return
        if path in ("/discover", "/time"):
            return
        if authorization is None or not authorization.startswith("Bearer "):
            raise _Rejected(
                self._unauthorized(
                    "Authentication required. Provide an Authorization: Bearer <token> header."
                )
            )
        claims = self._verify(authorization[len("Bearer ") :])
        if scope is not None and scope not in claims["scopes"]:
            listed = ", ".join(f"'{s}'" for s in claims["scopes"])
            raise _Rejected(
                _json(
                    403,
                    {
                        "error": f"Token for user '{claims['sub']}' lacks required scope "
                        f"'{scope}'. Token scopes: [{listed}]"
                    },
                )
            )

    def _unauthorized(self, message: str) -> Answer:
        answer = _json(401, {"error": message})
        answer.headers["WWW-Authenticate"] = 'Bearer realm="zeusd"'
        return answer

    def _verify(self, token: str) -> dict[str, Any]:
        """The claims of a valid token (jsonwebtoken's checks, in its order)."""
        assert self.signing_key is not None
        try:
            header_b64, body_b64, signature_b64 = token.split(".")
            header = json.loads(_unb64(header_b64))
            if header.get("alg") != "HS256":
                raise ValueError("InvalidAlgorithm")
            expected = hmac.new(
                self.signing_key, f"{header_b64}.{body_b64}".encode(), hashlib.sha256
            ).digest()
            if not hmac.compare_digest(expected, _unb64(signature_b64)):
                raise ValueError("InvalidSignature")
            claims = json.loads(_unb64(body_b64))
            if not isinstance(claims.get("sub"), str):
                raise ValueError("JSON error: missing field `sub`")
            scopes = claims.get("scopes")
            if not isinstance(scopes, list) or any(s not in ALL_GROUPS for s in scopes):
                raise ValueError("JSON error: invalid scopes")
            exp = claims.get("exp")
            if exp is not None and not isinstance(exp, int):
                raise ValueError("JSON error: invalid exp")
        except (ValueError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Rejected(self._unauthorized(f"Invalid token: {exc}")) from None
        if exp is not None and exp + _LEEWAY_S < self.now_s():
            raise _Rejected(self._unauthorized("Token has expired."))
        return claims

    def _route(
        self, method: str, path: str, query: dict[str, str], authorization: str | None
    ) -> Answer:
        if path == "/discover":
            return self._only(method, "GET") or self._discover(query)
        if path == "/time":
            return self._only(method, "GET") or _json(
                200, {"timestamp_ms": int(self.now_s() * 1000)}
            )
        if path == "/auth/whoami":
            assert authorization is not None  # the middleware let it through
            claims = self._verify(authorization[len("Bearer ") :])
            return self._only(method, "GET") or _json(200, claims)
        if path in _WRITES and (path != "/gpu/reset_locked_clocks" or self.schema == "master"):
            return self._only(method, "POST") or self._write(path, query)
        if path in _READS:
            return self._only(method, "GET") or self._read(path, query)
        return Answer(404, content_type="text/plain")  # actix's default service

    @staticmethod
    def _only(method: str, allowed: str) -> Answer | None:
        return None if method == allowed else Answer(405, content_type="text/plain")

    def _discover(self, query: dict[str, str]) -> Answer:
        base = {
            "enabled_api_groups": list(self.enable),
            "auth_required": self.signing_key is not None,
        }
        ids = list(range(len(self._names)))
        if self.schema == "0.4":
            return _json(200, {"gpu_ids": ids, "cpu_ids": [], "dram_available": [], **base})
        gpus: list[dict[str, Any]] = [{"id": i, "name": self._names[i]} for i in ids]
        if self.schema == "master":
            for gpu in gpus:
                gpu["pci_address"] = self._pci[gpu["id"]]
                gpu["cumulative_energy_available"] = self._energy_ok[gpu["id"]]
        return _json(200, {"gpus": gpus, "cpus": [], **base})

    # ------------------------------------------------------------------ parameters
    @staticmethod
    def _fields(
        query: dict[str, str], expected: Sequence[str], optional: Sequence[str] = ()
    ) -> None:
        allowed = [*expected, *optional]
        for key in query:
            if key not in allowed:
                listed = ", ".join(f"`{k}`" for k in allowed)
                raise _Rejected(
                    _text(
                        400,
                        f"Query deserialize error: unknown field `{key}`, expected one of {listed}",
                    )
                )
        for key in expected:
            if key not in query:
                raise _Rejected(_text(400, f"Query deserialize error: missing field `{key}`"))

    @staticmethod
    def _bool(text: str) -> bool:
        if text not in ("true", "false"):
            raise _Rejected(
                _text(400, "Query deserialize error: provided string was not `true` or `false`")
            )
        return text == "true"

    @staticmethod
    def _u32(text: str) -> int:
        if not text.isdigit() or int(text) >= 1 << 32:
            raise _Rejected(_text(400, "Query deserialize error: invalid digit found in string"))
        return int(text)

    def _ids(self, raw: str) -> list[int]:
        """zeusd's parse_device_ids: a JSON 400 for an empty or bad list."""
        if not raw.strip():
            raise _Rejected(_json(400, {"error": "gpu_ids must contain at least one GPU index"}))
        ids = []
        for part in raw.split(","):
            part = part.strip()
            if not part:
                raise _Rejected(_json(400, {"error": "gpu_ids contains an empty GPU index"}))
            if not part.isdigit():
                raise _Rejected(_json(400, {"error": f"Invalid GPU index: {part}"}))
            ids.append(int(part))
        return sorted(set(ids))

    # ------------------------------------------------------------------ commands
    def _write(self, path: str, query: dict[str, str]) -> Answer:
        fields = _WRITES[path]
        self._fields(query, ["gpu_ids", *fields, "block"])
        block = self._bool(query["block"])
        values = [self._bool(query[f]) if f == "enabled" else self._u32(query[f]) for f in fields]
        ids = self._ids(query["gpu_ids"])
        missing = [i for i in ids if i >= len(self._queues)]
        if missing:
            return _text(400, f"GPU index {missing[0]} does not exist.")
        command = self._command(path, values)
        if not block:
            for gpu_id in ids:
                self._queues[gpu_id].put((gpu_id, command, None))
            return Answer(200, content_type="text/plain")
        return self._run(ids, command, lambda gpu_id, result: None)

    def _read(self, path: str, query: dict[str, str]) -> Answer:
        self._fields(query, [], optional=["gpu_ids"])
        if "gpu_ids" in query:
            ids = self._ids(query["gpu_ids"])
            for gpu_id in ids:
                if gpu_id >= len(self._queues):
                    return _json(400, {"error": f"GPU {gpu_id} not found"})
        else:
            ids = list(range(len(self._queues)))
        command = self._command(path, [])
        if path == "/gpu/get_power":
            answer = self._run(ids, command, lambda gpu_id, power_mw: power_mw)
            if answer.status != 200:
                return answer
            readings = json.loads(answer.body)
            return _json(
                200,
                {
                    "timestamp_ms": int(self.now_s() * 1000),
                    "power_mw": {k: v for k, v in readings.items()},
                },
            )
        return self._run(ids, command, lambda gpu_id, fields: fields)

    def _command(self, path: str, values: list[Any]) -> Callable[[Any], Any]:
        """What one GPU's worker runs for ``path`` (pynvml calls, as root)."""
        nvml = self.nvml

        def instant_power_mw(handle: Any) -> int:
            (value,) = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_POWER_INSTANT])
            if value.nvmlReturn != 0:
                raise nvml.NVMLError(value.nvmlReturn)
            if value.valueType == 1:
                return int(value.value.uiVal)
            if value.valueType == 3:
                return int(value.value.ullVal)
            raise nvml.NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])

        commands: dict[str, Callable[[Any], Any]] = {
            "/gpu/set_persistence_mode": lambda h: nvml.nvmlDeviceSetPersistenceMode(
                h, int(values[0])
            ),
            "/gpu/set_power_limit": lambda h: nvml.nvmlDeviceSetPowerManagementLimit(h, values[0]),
            "/gpu/set_gpu_locked_clocks": lambda h: nvml.nvmlDeviceSetGpuLockedClocks(h, *values),
            "/gpu/reset_gpu_locked_clocks": nvml.nvmlDeviceResetGpuLockedClocks,
            "/gpu/set_mem_locked_clocks": lambda h: nvml.nvmlDeviceSetMemoryLockedClocks(
                h, *values
            ),
            "/gpu/reset_mem_locked_clocks": nvml.nvmlDeviceResetMemoryLockedClocks,
            "/gpu/reset_locked_clocks": lambda h: (
                nvml.nvmlDeviceResetGpuLockedClocks(h),
                nvml.nvmlDeviceResetMemoryLockedClocks(h),
            ),
            "/gpu/get_cumulative_energy": lambda h: {
                "energy_mj": nvml.nvmlDeviceGetTotalEnergyConsumption(h)
            },
            "/gpu/get_power_limit": lambda h: {
                "power_limit_mw": nvml.nvmlDeviceGetPowerManagementLimit(h)
            },
            "/gpu/get_power_limit_constraints": lambda h: dict(
                zip(
                    ("min_power_limit_mw", "max_power_limit_mw"),
                    nvml.nvmlDeviceGetPowerManagementLimitConstraints(h),
                    strict=True,
                )
            ),
            "/gpu/get_persistence_mode": lambda h: {
                "enabled": nvml.nvmlDeviceGetPersistenceMode(h) == 1
            },
            "/gpu/get_power": instant_power_mw,
        }
        return commands[path]

    def _run(
        self, ids: list[int], command: Callable[[Any], Any], shape: Callable[[int, Any], Any]
    ) -> Answer:
        """Run ``command`` on each GPU's worker (in its arrival order), wait for all."""
        waits = []
        for gpu_id in ids:
            done: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
            self._queues[gpu_id].put((gpu_id, command, done))
            waits.append((gpu_id, done))
        results: dict[str, Any] = {}
        errors: dict[str, tuple[int, str]] = {}
        for gpu_id, done in waits:
            ok, value = done.get()
            if ok:
                results[str(gpu_id)] = shape(gpu_id, value)
            else:
                errors[str(gpu_id)] = value
        if errors:
            worst = max(status for status, _ in errors.values())
            return _json(worst, {"errors": {k: message for k, (_, message) in errors.items()}})
        if all(v is None for v in results.values()):
            return Answer(200, content_type="text/plain")
        return _json(200, results)

    def _work(self, commands: queue.Queue[Any]) -> None:
        """One GPU's management task: its commands, one at a time, in arrival order."""
        while True:
            item = commands.get()
            if item is None:
                return
            gpu_id, command, done = item
            try:
                with self.nvml.as_root():
                    value = command(self.nvml.nvmlDeviceGetHandleByIndex(gpu_id))
            except self.nvml.NVMLError as exc:  # the module's own class, however imported
                status = {
                    ERROR_CODES["NVML_ERROR_NO_PERMISSION"]: 403,
                    ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"]: 400,
                    ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"]: 400,
                }.get(exc.value, 500)
                outcome: tuple[bool, Any] = (False, (status, f"NVML error: {exc}"))
            else:
                outcome = (True, value)
            if done is None:
                if not outcome[0]:
                    self.log.append((gpu_id, outcome[1][1]))
            else:
                done.put(outcome)

    def _pci_address(self, handle: Any) -> str:
        pci = self.nvml.nvmlDeviceGetPciInfo(handle)
        return f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.0"

    def wait_released(self) -> None:
        """Block while :meth:`hold` holds answers (the request handlers call this)."""
        self._released.wait()


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def _handler(daemon: FakeZeusd) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            answer = daemon.answer(self.command, self.path, self.headers.get("Authorization"))
            daemon.wait_released()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(len(answer.body)))
            for key, value in answer.headers.items():
                self.send_header(key, value)
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(answer.body)

        do_GET = do_POST = do_PUT = _serve

        def address_string(self) -> str:
            return "fake-zeusd-client"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet, as a daemon's access log is not the test's output

        def handle(self) -> None:
            with contextlib.suppress(ConnectionError, socket.timeout):
                super().handle()

    return Handler


#: The key the test daemons sign tokens with.
SIGNING_KEY = b"fake-zeusd-signing-key-of-32-bytes!"
#: What a job needs: change and read GPUs.
JOB_SCOPES = ("gpu-control", "gpu-read")


@dataclass
class Node:
    """A GPU node with zeusd: the fake driver, the daemon, the token of this job's user.

    Attributes:
        nvml: the fake pynvml module, installed as ``pynvml`` (setters need root).
        daemon: zeusd, started, serving ``nvml``'s GPUs.
        token: a token the daemon accepts (None: the daemon needs none).
    """

    nvml: FakeNVML
    daemon: FakeZeusd
    token: str | None


@contextlib.contextmanager
def zeusd_node(
    monkeypatch: Any,
    socket_path: Path,
    devices: Sequence[Any],
    *,
    scopes: Sequence[str] | None = JOB_SCOPES,
    schema: str = "master",
    privileged: bool = False,
    configure: bool = True,
) -> Iterator[Node]:
    """A node whose GPUs this process may only change through zeusd.

    Args:
        monkeypatch: the test's monkeypatch (``pynvml``, the environment, privileges).
        socket_path: where the daemon listens.
        devices: the fake GPUs.
        scopes: the token's scopes; None: the daemon requires no token.
        schema: the daemon's ``/discover`` schema.
        privileged: this process holds ``CAP_SYS_ADMIN`` (NVML setters allowed too).
        configure: export ``ZEUSD_SOCK_PATH`` (and ``ZEUSD_TOKEN``).
    """
    nvml = make_module(list(devices))
    nvml.require_root = not privileged
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    status = socket_path.with_name("status")
    status.write_text(f"CapEff:\t{'000001ffffffffff' if privileged else '0000000000000000'}\n")
    monkeypatch.setattr(zeusd, "PROC_STATUS", status)
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LIGHTNING_ENERGY_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    key = None if scopes is None else SIGNING_KEY
    token = None if scopes is None else issue_token(SIGNING_KEY, "alice", scopes)
    with FakeZeusd(nvml, socket_path=socket_path, signing_key=key, schema=schema) as daemon:
        if configure:
            for var, value in daemon.env(token).items():
                monkeypatch.setenv(var, value)
        yield Node(nvml=nvml, daemon=daemon, token=token)
