"""A client of zeusd, the Zeus daemon that changes GPU settings for unprivileged processes.

zeusd (crate ``zeusd``, Docker image ``mlenergy/zeusd``) runs as root and answers HTTP on a
Unix socket (default ``/run/zeusd/zeusd.sock``; ``/var/run/zeusd.sock`` up to 0.4) or on
TCP (``127.0.0.1:4938``). Clients find it through ``ZEUSD_SOCK_PATH``, else
``ZEUSD_HOST_PORT`` (``host:port``), and send ``ZEUSD_TOKEN`` as
``Authorization: Bearer ...`` when the daemon requires a token. This module speaks that API
with the standard library only (:mod:`http.client`, with a connection class of its own for
a Unix socket), one connection per request, each with a timeout.

Every parameter is a query parameter, also on ``POST``; ``gpu_ids`` are the daemon's GPU
indices (NVML's, as the daemon enumerates them). Writes are always sent with
``block=true``: the answer comes once the driver has applied the setting, and a driver
error is reported; with ``block=false`` zeusd answers 200 at once and only logs failures,
which would leave a setting this package must restore unknown.

Answers are checked before use (strict JSON of at most :data:`MAX_ANSWER_BYTES`, every field
with its type and range): a malformed answer is a :class:`~lightning_energy.errors.DriverError`
naming the endpoint, never a value made up. Errors translate at this boundary:

=====================================================  ===================================
what happened                                          raised
=====================================================  ===================================
no socket, nothing listening, no answer in time        :class:`DaemonUnreachableError`
401 (no token, a bad or expired one)                   :class:`NoPermissionError`
403 (a token without the scope, or the driver          :class:`NoPermissionError`
refused the daemon)
404 (an API group the daemon does not enable, or an     :class:`NotSupportedError`
endpoint this zeusd lacks)
400 with per-GPU driver errors (invalid, unsupported)  :class:`NotSupportedError`
anything else (400 for a request, 5xx)                 :class:`DriverError`
=====================================================  ===================================

The token is a secret: it is held in a private attribute, never shown by ``repr``, never
logged, and removed from any text of the daemon's that an error repeats.
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from lightning_energy.device.lease_fields import (
    MAX_TEXT,
    field,
    kind_of,
    parse_json,
    read_int,
    read_text,
    show,
)
from lightning_energy.errors import (
    ConfigError,
    DaemonUnreachableError,
    DeviceError,
    DriverError,
    NoPermissionError,
    NotSupportedError,
)

__all__ = [
    "CONTROL_SCOPE",
    "DEFAULT_SOCKET_PATHS",
    "HOST_PORT_ENV",
    "MAX_ANSWER_BYTES",
    "REQUEST_TIMEOUT_S",
    "SCOPE_FIX",
    "SOCK_PATH_ENV",
    "TOKEN_ENV",
    "TOKEN_FIX",
    "DaemonGPU",
    "Discovery",
    "Whoami",
    "ZeusdAddress",
    "ZeusdClient",
]

log = logging.getLogger(__name__)

SOCK_PATH_ENV = "ZEUSD_SOCK_PATH"
HOST_PORT_ENV = "ZEUSD_HOST_PORT"
TOKEN_ENV = "ZEUSD_TOKEN"
#: Where zeusd listens by default: 0.5 and later, then 0.4 and earlier.
DEFAULT_SOCKET_PATHS = ("/run/zeusd/zeusd.sock", "/var/run/zeusd.sock")
#: Seconds to connect and to wait for each answer.
REQUEST_TIMEOUT_S = 5.0
#: The largest answer read (a real one is well under 1 KiB per GPU).
MAX_ANSWER_BYTES = 1 << 20
#: The scope a token needs to change GPU settings.
CONTROL_SCOPE = "gpu-control"
#: How to get a token, where none is sent.
TOKEN_FIX = (
    f"set {TOKEN_ENV} to a token from `zeusd token issue` with the scopes {CONTROL_SCOPE} "
    "and gpu-read"
)
#: How to get a token that may change GPU settings.
SCOPE_FIX = (
    f"ask the administrator for a token with the scope {CONTROL_SCOPE} and set {TOKEN_ENV} to it"
)

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_MAX_GPUS = 1 << 16
_MAX_SHOWN = 300
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,8192}")


@dataclass(frozen=True)
class ZeusdAddress:
    """Where zeusd listens: a Unix socket path, or a TCP host and port.

    ``str()`` gives ``unix:<path>`` or ``tcp:<host>:<port>``; :meth:`parse` reads it back
    (a lease records it so).
    """

    socket_path: str | None = None
    host: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        if self.socket_path is not None:
            return f"unix:{self.socket_path}"
        return f"tcp:{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> ZeusdAddress:
        """Read ``unix:<absolute path>`` or ``tcp:<host>:<port>``.

        Raises:
            ValueError: anything else, in words.
        """
        if text.startswith("unix:"):
            path = text[len("unix:") :]
            if not path or not os.path.isabs(path) or "\0" in path:
                raise ValueError(f"{show(text)} does not name an absolute socket path")
            return cls(socket_path=path)
        if text.startswith("tcp:"):
            host, port = _host_port(text[len("tcp:") :])
            return cls(host=host, port=port)
        raise ValueError(f"{show(text)} is not unix:<path> or tcp:<host>:<port>")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeusdAddress | None:
        """The address ``ZEUSD_SOCK_PATH``, else ``ZEUSD_HOST_PORT``, names; None when
        neither is set.

        Raises:
            ConfigError: a variable is set but empty, or not ``host:port``.
        """
        env = os.environ if environ is None else environ
        path = env.get(SOCK_PATH_ENV)
        if path is not None:
            if not path.strip() or "\0" in path:
                raise ConfigError(
                    f"{SOCK_PATH_ENV}: {path!r} is not allowed; use the path of zeusd's "
                    f"socket (default {DEFAULT_SOCKET_PATHS[0]}), or unset it",
                    source=f"env {SOCK_PATH_ENV}",
                )
            return cls(socket_path=os.path.abspath(path.strip()))
        host_port = env.get(HOST_PORT_ENV)
        if host_port is None:
            return None
        try:
            host, port = _host_port(host_port.strip())
        except ValueError as exc:
            raise ConfigError(
                f"{HOST_PORT_ENV}: {exc}; use host:port, e.g. 127.0.0.1:4938, or unset it",
                source=f"env {HOST_PORT_ENV}",
            ) from None
        return cls(host=host, port=port)

    @classmethod
    def default(cls) -> ZeusdAddress:
        """zeusd's default socket: the first of :data:`DEFAULT_SOCKET_PATHS` that exists,
        else the current default (whose absence an error will name)."""
        found = next((p for p in DEFAULT_SOCKET_PATHS if os.path.exists(p)), None)
        return cls(socket_path=found or DEFAULT_SOCKET_PATHS[0])


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise ValueError(f"{show(text)} is not host:port with a port in 1..65535")
    if not host.isprintable() or any(c.isspace() for c in host):
        raise ValueError(f"{show(text)} has a host that is not a host name")
    return host, int(port)


@dataclass(frozen=True)
class DaemonGPU:
    """A GPU zeusd manages, as ``/discover`` describes it.

    Attributes:
        id: the index zeusd's endpoints take (NVML's index on the daemon's side).
        name: the model name (None: zeusd 0.4 does not give it).
        pci_address: ``domain:bus:device.function`` (None: zeusd 0.5.0 and older do not
            give it).
    """

    id: int
    name: str | None = None
    pci_address: str | None = None


@dataclass(frozen=True)
class Discovery:
    """What ``GET /discover`` says about the daemon.

    Attributes:
        schema: the shape of the answer: ``"0.4"`` (``gpu_ids`` only), ``"0.5"`` (GPUs
            with their names) or ``"pci"`` (later: GPUs with PCI addresses too). zeusd
            does not report its version; the schema is what tells releases apart.
        gpus: the GPUs it manages.
        api_groups: the API groups it enables (``gpu-control``, ``gpu-read``, ``cpu-read``).
        auth_required: whether it requires a token.
    """

    schema: str
    gpus: tuple[DaemonGPU, ...]
    api_groups: tuple[str, ...]
    auth_required: bool

    def describe_schema(self) -> str:
        """The schema in words, for ``doctor``."""
        return {
            "0.4": "zeusd 0.4 (GPU indices only)",
            "0.5": "zeusd 0.5.0 (GPU names)",
            "pci": "zeusd after 0.5.0 (GPU names and PCI addresses)",
        }[self.schema]


@dataclass(frozen=True)
class Whoami:
    """What ``GET /auth/whoami`` says about the token sent.

    Attributes:
        sub: the user the token was issued to.
        scopes: the API groups it may use.
        exp: when it expires (Unix seconds), None: never.
    """

    sub: str
    scopes: tuple[str, ...]
    exp: int | None


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: :class:`http.client.HTTPConnection` with its own socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class ZeusdClient:
    """Requests to one zeusd, with a timeout, typed answers and typed errors.

    Thread-safe: each request opens its own connection.

    Args:
        address: where the daemon listens.
        token: the bearer token (None or empty: send none).
        timeout_s: seconds to connect and to wait for each answer.

    Raises:
        ConfigError: ``token`` is not a token (it is never repeated), or ``timeout_s`` is
            not a positive number.
    """

    def __init__(
        self,
        address: ZeusdAddress,
        *,
        token: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        problems = []
        if token is not None:
            token = token.strip() or None  # an empty token is none, as in Zeus' own client
        if token is not None and not _TOKEN.fullmatch(token):
            problems.append(
                f"{TOKEN_ENV}: the value is not a zeusd token (a JWT of letters, digits and "
                "'.-_'; not shown); set it to the output of `zeusd token issue`"
            )
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            problems.append(f"timeout_s: {timeout_s!r} is not allowed; use seconds > 0")
        if problems:
            raise ConfigError(problems, source="zeusd")
        self._address = address
        self._token = token
        self._timeout_s = timeout_s

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeusdClient | None:
        """The client the environment configures (``ZEUSD_SOCK_PATH`` or
        ``ZEUSD_HOST_PORT``, with ``ZEUSD_TOKEN``); None when neither address is set.

        Raises:
            ConfigError: a variable is set to something unusable.
        """
        env = os.environ if environ is None else environ
        address = ZeusdAddress.from_env(env)
        return None if address is None else cls(address, token=env.get(TOKEN_ENV))

    @classmethod
    def for_address(
        cls, address: ZeusdAddress, environ: Mapping[str, str] | None = None
    ) -> ZeusdClient:
        """A client of ``address`` with the environment's ``ZEUSD_TOKEN``.

        Raises:
            ConfigError: the token is unusable.
        """
        env = os.environ if environ is None else environ
        return cls(address, token=env.get(TOKEN_ENV))

    def __repr__(self) -> str:
        token = "set" if self._token else "none"
        return f"ZeusdClient({str(self._address)!r}, token={token})"

    @property
    def address(self) -> ZeusdAddress:
        """Where the daemon listens."""
        return self._address

    @property
    def has_token(self) -> bool:
        """Whether a token is sent."""
        return self._token is not None

    # ------------------------------------------------------------------ endpoints
    def discover(self) -> Discovery:
        """``GET /discover``: the daemon's GPUs, API groups and whether it needs a token.

        Raises:
            DaemonUnreachableError: no answer.
            DriverError: an error status, or an answer of none of the known shapes.
        """
        data = self._json("GET", "/discover", {})
        return self._checked("/discover", data, _parse_discovery)

    def whoami(self) -> Whoami:
        """``GET /auth/whoami``: who the token belongs to and what it may do.

        Raises:
            NoPermissionError: no token, or one the daemon refuses (401).
            NotSupportedError: the daemon requires no token (it has no ``/auth``).
            DaemonUnreachableError: no answer.
            DriverError: another error status, or a malformed answer.
        """
        data = self._json("GET", "/auth/whoami", {})
        return self._checked("/auth/whoami", data, _parse_whoami)

    def power_limit_mw(self, gpu_id: int, *, gpu_index: int | None = None) -> int:
        """``GET /gpu/get_power_limit``: the power limit set, in mW."""
        fields = self._gpu_read("/gpu/get_power_limit", gpu_id, gpu_index)
        return self._checked(
            "/gpu/get_power_limit", fields, lambda d: read_int(d, "power_limit_mw", 0, _U32)
        )

    def power_limit_constraints_mw(
        self, gpu_id: int, *, gpu_index: int | None = None
    ) -> tuple[int, int]:
        """``GET /gpu/get_power_limit_constraints``: the (min, max) limit, in mW."""
        path = "/gpu/get_power_limit_constraints"
        fields = self._gpu_read(path, gpu_id, gpu_index)

        def parse(data: dict[str, Any]) -> tuple[int, int]:
            lo = read_int(data, "min_power_limit_mw", 0, _U32)
            hi = read_int(data, "max_power_limit_mw", lo, _U32)
            return lo, hi

        return self._checked(path, fields, parse)

    def energy_mj(self, gpu_id: int, *, gpu_index: int | None = None) -> int:
        """``GET /gpu/get_cumulative_energy``: the energy counter, in mJ."""
        fields = self._gpu_read("/gpu/get_cumulative_energy", gpu_id, gpu_index)
        return self._checked(
            "/gpu/get_cumulative_energy", fields, lambda d: read_int(d, "energy_mj", 0, _U64)
        )

    def power_mw(self, gpu_id: int, *, gpu_index: int | None = None) -> int:
        """``GET /gpu/get_power``: the power drawn now, in mW."""
        path = "/gpu/get_power"
        data = self._json("GET", path, {"gpu_ids": str(gpu_id)}, gpu_index=gpu_index)

        def parse(snapshot: Any) -> int:
            if not isinstance(snapshot, dict):
                raise ValueError(f"a JSON object is needed, not {kind_of(snapshot)}")
            read_int(snapshot, "timestamp_ms", 0, _U64)
            readings = snapshot.get("power_mw")
            if not isinstance(readings, dict):
                raise ValueError(f"power_mw: an object is needed, not {kind_of(readings)}")
            return read_int(readings, str(gpu_id), 0, _U32, prefix="power_mw.")

        return self._checked(path, data, parse, gpu_index)

    def set_power_limit_mw(self, gpu_id: int, power_limit_mw: int, *, gpu_index: int) -> None:
        """``POST /gpu/set_power_limit``, waiting until the driver applied it."""
        self._write("/gpu/set_power_limit", gpu_id, gpu_index, power_limit_mw=power_limit_mw)

    def set_gpu_locked_clocks_mhz(
        self, gpu_id: int, min_mhz: int, max_mhz: int, *, gpu_index: int
    ) -> None:
        """``POST /gpu/set_gpu_locked_clocks``, waiting until the driver applied it."""
        self._write(
            "/gpu/set_gpu_locked_clocks",
            gpu_id,
            gpu_index,
            min_clock_mhz=min_mhz,
            max_clock_mhz=max_mhz,
        )

    def reset_gpu_locked_clocks(self, gpu_id: int, *, gpu_index: int) -> None:
        """``POST /gpu/reset_gpu_locked_clocks`` (every zeusd has it; the newer
        ``reset_locked_clocks`` also resets memory clocks, which this package never locks)."""
        self._write("/gpu/reset_gpu_locked_clocks", gpu_id, gpu_index)

    # ------------------------------------------------------------------ transport
    def _write(self, path: str, gpu_id: int, gpu_index: int, **values: int) -> None:
        params = {"gpu_ids": str(gpu_id), **{k: str(v) for k, v in values.items()}}
        self._request("POST", path, {**params, "block": "true"}, gpu_index)

    def _gpu_read(self, path: str, gpu_id: int, gpu_index: int | None) -> Any:
        """One GPU's object of a per-GPU read answer (``{"<id>": {...}}``)."""
        data = self._json("GET", path, {"gpu_ids": str(gpu_id)}, gpu_index=gpu_index)

        def one(answer: Any) -> dict[str, Any]:
            if not isinstance(answer, dict):
                raise ValueError(f"a JSON object is needed, not {kind_of(answer)}")
            fields = answer.get(str(gpu_id))
            if not isinstance(fields, dict):
                raise ValueError(f"{gpu_id}: an object is needed, not {kind_of(fields)}")
            return fields

        return self._checked(path, data, one, gpu_index)

    def _json(
        self, method: str, path: str, params: dict[str, str], *, gpu_index: int | None = None
    ) -> Any:
        body = self._request(method, path, params, gpu_index)
        return self._checked(path, body, parse_json, gpu_index)

    def _checked(
        self,
        path: str,
        data: Any,
        parse: Callable[[Any], Any],
        gpu_index: int | None = None,
    ) -> Any:
        """``parse(data)``, a malformed answer becoming a :class:`DriverError`."""
        try:
            return parse(data)
        except (ValueError, TypeError, KeyError) as exc:
            raise DriverError(
                f"zeusd at {self._address} answered {path} with a malformed body: "
                f"{self._scrub(str(exc))}",
                gpu_index=gpu_index,
                operation=_operation(path),
            ) from None

    def _request(
        self, method: str, path: str, params: dict[str, str], gpu_index: int | None
    ) -> bytes:
        """Send one request; the body of a 200 answer, or the translated error."""
        target = path + ("?" + urlencode(params, safe=",", quote_via=quote) if params else "")
        headers = {"Accept": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        where = f"zeusd at {self._address}"
        log.debug("%s: %s %s", where, method, target)
        conn = self._connection()
        try:
            try:
                conn.connect()
            except OSError as exc:  # nothing was sent
                raise DaemonUnreachableError(
                    f"{where} cannot be reached for {method} {path}: "
                    f"{self._scrub(_describe_os_error(exc))}{self._address_hint()}",
                    gpu_index=gpu_index,
                    operation=_operation(path),
                ) from None
            try:
                conn.request(method, target, headers=headers)
                answer = conn.getresponse()
                status = answer.status
                body = answer.read(MAX_ANSWER_BYTES + 1)
            except TimeoutError:
                change = " (the change may still be applied)" if method == "POST" else ""
                raise DaemonUnreachableError(
                    f"{where} did not answer {method} {path} within {self._timeout_s:g} s{change}",
                    gpu_index=gpu_index,
                    operation=_operation(path),
                    maybe_applied=method == "POST",
                ) from None
            except (OSError, http.client.HTTPException) as exc:  # the request may have arrived
                change = " (the change may still be applied)" if method == "POST" else ""
                raise DaemonUnreachableError(
                    f"{where} dropped the connection during {method} {path}: "
                    f"{self._scrub(_describe_os_error(exc))}{change}",
                    gpu_index=gpu_index,
                    operation=_operation(path),
                    maybe_applied=method == "POST",
                ) from None
        finally:
            conn.close()
        if len(body) > MAX_ANSWER_BYTES:
            raise DriverError(
                f"{where} answered {method} {path} with more than {MAX_ANSWER_BYTES} bytes",
                gpu_index=gpu_index,
                operation=_operation(path),
            )
        if status == 200:
            return body
        raise self._status_error(method, path, status, body, gpu_index)

    def _connection(self) -> http.client.HTTPConnection:
        if self._address.socket_path is not None:
            return _UnixConnection(self._address.socket_path, self._timeout_s)
        assert self._address.host is not None and self._address.port is not None
        return http.client.HTTPConnection(
            self._address.host, self._address.port, timeout=self._timeout_s
        )

    def _address_hint(self) -> str:
        if self._address.socket_path is not None:
            return f"; is zeusd running? (set {SOCK_PATH_ENV} to its socket)"
        return f"; is zeusd running? (set {HOST_PORT_ENV} to its host:port)"

    def _status_error(
        self, method: str, path: str, status: int, body: bytes, gpu_index: int | None
    ) -> DeviceError:
        """The typed error of a non-200 answer, with what the daemon said."""
        said, per_gpu = self._said(body)
        message = f"zeusd at {self._address} answered {method} {path} with {status}: {said}"
        operation = _operation(path)
        if status == 401:
            fix = (
                TOKEN_FIX
                if self._token is None
                else f"ask the administrator for a new token (with the scope {CONTROL_SCOPE}) "
                f"and set {TOKEN_ENV} to it"
            )
            return NoPermissionError(message, gpu_index=gpu_index, operation=operation, fix=fix)
        if status == 403:
            fix = (
                "the daemon itself may not change the GPU: run zeusd as root (see "
                "docs/permissions.md)"
                if per_gpu
                else SCOPE_FIX
            )
            return NoPermissionError(message, gpu_index=gpu_index, operation=operation, fix=fix)
        if status == 404:
            return NotSupportedError(
                message + " (an API group this daemon does not enable, or an endpoint it lacks)",
                gpu_index=gpu_index,
                operation=operation,
            )
        if status == 400 and per_gpu:
            return NotSupportedError(message, gpu_index=gpu_index, operation=operation)
        return DriverError(message, gpu_index=gpu_index, operation=operation)

    def _said(self, body: bytes) -> tuple[str, bool]:
        """What an error answer says, printable and short, and whether it lists per-GPU
        driver errors (``{"errors": {"0": "..."}}``)."""
        try:
            data = parse_json(body)
        except ValueError:
            data = None
        per_gpu = False
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            text = data["error"]
        elif isinstance(data, dict) and isinstance(data.get("errors"), dict):
            per_gpu = True
            text = "; ".join(f"GPU {k}: {v}" for k, v in sorted(data["errors"].items()))
        else:
            text = body.decode("utf-8", errors="replace")
        text = "".join(c if c.isprintable() else " " for c in text).strip() or "(no message)"
        if len(text) > _MAX_SHOWN:
            text = text[: _MAX_SHOWN - 3] + "..."
        return self._scrub(text), per_gpu

    def _scrub(self, text: str) -> str:
        """``text`` without the token (a daemon, or a proxy in front of it, may echo it)."""
        return text.replace(self._token, "***") if self._token else text


def _operation(path: str) -> str:
    """``/gpu/set_power_limit`` -> ``zeusd set_power_limit``."""
    return f"zeusd {path.rsplit('/', 1)[-1] or path}"


def _describe_os_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------- answers
def _parse_discovery(data: Any) -> Discovery:
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object is needed, not {kind_of(data)}")
    groups = _text_list(data, "enabled_api_groups")
    auth = field(data, "auth_required")
    if not isinstance(auth, bool):
        raise ValueError(f"auth_required: {show(auth)} is not true or false")
    if "gpus" in data:
        raw = data["gpus"]
        if not isinstance(raw, list):
            raise ValueError(f"gpus: a list is needed, not {kind_of(raw)}")
        gpus = tuple(_parse_gpu(entry, i) for i, entry in enumerate(raw))
        with_pci = [g.pci_address is not None for g in gpus]
        if any(with_pci) and not all(with_pci):
            raise ValueError("gpus: some GPUs have a pci_address and others not")
        schema = "pci" if gpus and all(with_pci) else "0.5"
    elif "gpu_ids" in data:
        ids = data["gpu_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"gpu_ids: a list is needed, not {kind_of(ids)}")
        gpus = tuple(DaemonGPU(id=_gpu_id(v, f"gpu_ids[{i}]")) for i, v in enumerate(ids))
        schema = "0.4"
    else:
        raise ValueError("neither gpus nor gpu_ids: not a zeusd /discover answer")
    ids = [g.id for g in gpus]
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU ids {ids} repeat an id")
    return Discovery(schema=schema, gpus=gpus, api_groups=groups, auth_required=auth)


def _parse_gpu(entry: Any, i: int) -> DaemonGPU:
    prefix = f"gpus[{i}]."
    if not isinstance(entry, dict):
        raise ValueError(f"gpus[{i}]: an object is needed, not {kind_of(entry)}")
    pci = entry.get("pci_address")
    if pci is not None:
        pci = read_text(entry, "pci_address", prefix).lower()
        if not _PCI_ADDRESS.fullmatch(pci):
            raise ValueError(f"{prefix}pci_address: {show(pci)} is not a PCI address")
    return DaemonGPU(
        id=_gpu_id(field(entry, "id", prefix), f"{prefix}id"),
        name=read_text(entry, "name", prefix),
        pci_address=pci,
    )


def _gpu_id(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_GPUS:
        raise ValueError(f"{where}: {show(value)} is not a GPU index in 0..{_MAX_GPUS - 1}")
    return value


def _text_list(data: dict[str, Any], key: str) -> tuple[str, ...]:
    value = field(data, key)
    if not isinstance(value, list):
        raise ValueError(f"{key}: a list is needed, not {kind_of(value)}")
    texts = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not 0 < len(item) <= MAX_TEXT or not item.isprintable():
            raise ValueError(f"{key}[{i}]: {show(item)} is not printable text")
        texts.append(item)
    return tuple(texts)


def _parse_whoami(data: Any) -> Whoami:
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object is needed, not {kind_of(data)}")
    exp = data.get("exp")
    return Whoami(
        sub=read_text(data, "sub"),
        scopes=_text_list(data, "scopes"),
        exp=None if exp is None else read_int(data, "exp", 0, _U64),
    )
