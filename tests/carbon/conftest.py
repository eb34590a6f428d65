"""Fixtures of the carbon tests: a real HTTP server on 127.0.0.1 serving recorded answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest


@dataclass
class Reply:
    """One canned answer: status, body, headers, and an optional delay before answering."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0

    @classmethod
    def json(
        cls,
        payload: Any,
        status: int = 200,
        delay_s: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        body = json.dumps(payload).encode()
        return cls(status, body, {"Content-Type": "application/json", **(headers or {})}, delay_s)

    @classmethod
    def file(cls, path: Path, status: int = 200, delay_s: float = 0.0, **headers: str) -> Reply:
        kind = "application/json" if path.suffix == ".json" else "text/html"
        return cls(status, path.read_bytes(), {"Content-Type": kind, **headers}, delay_s)


@dataclass
class Seen:
    """A request the server received."""

    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    raw_target: str


class ApiServer:
    """Routes (exact path, without query) to canned replies; a list of replies is served
    in order, its last one repeated."""

    def __init__(self) -> None:
        self.routes: dict[str, list[Reply]] = {}
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None
        port = self._httpd.server_address[1]
        return f"http://127.0.0.1:{port}"

    def route(self, path: str, *replies: Reply) -> None:
        with self._lock:
            self.routes[path] = list(replies)

    def requests_to(self, path: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.path == path]

    def _next_reply(self, path: str) -> Reply:
        with self._lock:
            replies = self.routes.get(path)
            if not replies:
                return Reply.json({"error": f"no route for {path}"}, status=404)
            return replies.pop(0) if len(replies) > 1 else replies[0]

    def start(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                with server._lock:
                    server.seen.append(
                        Seen(parts.path, parse_qs(parts.query), dict(self.headers), self.path)
                    )
                reply = server._next_reply(parts.path)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.01},
            name="carbon-test-server",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        assert self._httpd is not None and self._thread is not None
        self._httpd.shutdown()
        self._httpd.server_close()  # joins the request threads
        self._thread.join()


@pytest.fixture
def api_server() -> Iterator[ApiServer]:
    """A real HTTP server on 127.0.0.1 (thread ``carbon-test-server``), stopped after."""
    server = ApiServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api_dir(data_dir: Path) -> Path:
    """The recorded API answers."""
    return data_dir / "carbon_api"


class FakeSleep:
    """Records the waits asked for instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture
def fake_sleep() -> FakeSleep:
    return FakeSleep()
