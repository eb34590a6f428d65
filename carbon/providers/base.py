"""The provider interface and the HTTP plumbing the web providers share.

Every provider answers with :class:`~carbon.types.IntensityPoint` lists through the same
small interface (:class:`CarbonProvider`). The web providers derive from
:class:`HttpProvider`, which owns one ``requests.Session``, applies (connect, read)
timeouts, retries 5xx answers, timeouts and connection failures with exponential backoff,
honours ``Retry-After`` on 429, and translates every failure into the
:mod:`carbon.errors` tree.

Credentials are held in :class:`Secret` objects and only ever sent in request headers:
never in a URL (urllib3 logs URLs at DEBUG), a log record, an exception message or a
``repr``. Redirects are not followed, so a custom token header is never replayed to
another host.
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import Any, ClassVar, Protocol, runtime_checkable

import requests
from requests.adapters import HTTPAdapter

from carbon.errors import (
    AuthError,
    BadResponseError,
    CarbonConfigError,
    NoDataError,
    ProviderError,
    ProviderUnavailableError,
    QuotaError,
)
from carbon.types import IntensityPoint, as_utc

__all__ = [
    "CarbonProvider",
    "HttpProvider",
    "Secret",
    "fetch_in_windows",
    "parse_intensity",
    "parse_time",
    "points_between",
    "redact_url",
    "scrub_excerpt",
]

logger = logging.getLogger(__name__)

#: Default (connect, read) timeouts in seconds.
DEFAULT_TIMEOUT_S: tuple[float, float] = (3.05, 10.0)

#: The longest excerpt of a response body quoted in an error or a log record.
BODY_EXCERPT_CHARS = 200

_URL_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?(?P<userinfo>.*)@")


@runtime_checkable
class CarbonProvider(Protocol):
    """What the monitor and the CLI need from a source of carbon intensity.

    Every method answers in gCO2eq/kWh with timezone-aware UTC times, oldest first.
    """

    @property
    def name(self) -> str:
        """Short provider name (``"electricitymaps"``, ``"watttime"``, ``"uk"``...)."""
        ...

    @property
    def region(self) -> str:
        """The zone/region the provider reports on."""
        ...

    def latest(self) -> IntensityPoint:
        """The most recent value (measured or estimated)."""
        ...

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """Past values with interval starts in ``[start, end)``."""
        ...

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """Forecast values from now on, up to ``horizon_s`` seconds ahead."""
        ...


class Secret:
    """A credential that does not show itself: ``repr``/``str`` print ``***``.

    Args:
        value: the secret text.

    Example:
        >>> s = Secret("hunter2")
        >>> s, str(s), s.reveal()
        (***, '***', 'hunter2')
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself, to put in a request header."""
        return self._value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret cannot be pickled")


def redact_url(url: str) -> str:
    """``url`` with its credentials (``user:password@``) replaced by ``***@``.

    Everything between the scheme and the last ``@`` is masked, so a password holding
    ``/``, ``:`` or ``#`` is masked too. URLs are shown only through this function.

    Args:
        url: an API root such as ``"https://user:pass@proxy.example:8080/v3"``.

    Returns:
        The URL safe to show (``"https://***@proxy.example:8080/v3"``).

    Example:
        >>> redact_url("https://alice:s3cret@proxy:8080/v3")
        'https://***@proxy:8080/v3'
        >>> redact_url("https://api.example/v3")
        'https://api.example/v3'
    """
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme') or ''}***@", url, count=1)


def url_secrets(url: str) -> list[Secret]:
    """The credentials held in a URL's ``user:password@`` part (empty when none)."""
    match = _URL_USERINFO.match(url)
    if match is None:
        return []
    userinfo = match.group("userinfo")
    parts = [userinfo, *userinfo.split(":", 1)]
    return [Secret(p) for p in dict.fromkeys(parts) if p]


def scrub_excerpt(text: str, secrets: list[Secret], limit: int = BODY_EXCERPT_CHARS) -> str:
    """A short, single-line excerpt of ``text`` with every secret replaced by ``***``.

    The secrets are removed from the whole text *before* it is shortened, so a secret cut
    by the limit cannot leave a prefix behind. Every response body shown (error messages,
    log records) goes through this function.

    Args:
        text: e.g. a response body.
        secrets: the credentials to remove (longest first is not required).
        limit: the most characters kept; a longer excerpt ends with ``...``.

    Returns:
        The excerpt.

    Example:
        >>> scrub_excerpt("bad token tok-123 " + "x" * 300, [Secret("tok-123")], 20)
        'bad token *** xxx...'
    """
    for value in sorted((s.reveal() for s in secrets), key=len, reverse=True):
        if value:
            text = text.replace(value, "***")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_intensity(value: object, factor: float = 1.0) -> float:
    """A carbon intensity from a JSON value, checked to be a finite number >= 0.

    Args:
        value: the value as decoded from JSON (a number, or a number in a string).
        factor: the conversion to gCO2eq/kWh (e.g. from lbs/MWh).

    Returns:
        gCO2eq/kWh.

    Raises:
        ValueError: if the value is not a number (booleans are not), is negative, NaN
            or infinite. The message does not quote a string value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"the intensity is not a number but {type(value).__name__}")
    try:
        number = float(value) * factor
    except OverflowError:
        raise ValueError("the intensity is too large to be a number") from None
    except ValueError:
        raise ValueError("the intensity is not a number") from None
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"the intensity {number!r} gCO2eq/kWh is not a finite number >= 0")
    return number


def parse_time(text: str) -> datetime:
    """Parse an ISO 8601 time as sent by the APIs (``Z``, offsets, or naive meaning UTC).

    Args:
        text: e.g. ``"2024-03-05T20:00:00.000Z"``, ``"2021-04-30T22:30Z"``,
            ``"2022-07-15T00:00:00+00:00"``.

    Returns:
        A timezone-aware UTC datetime.

    Raises:
        ValueError: if the text is not a time, or not one a UTC datetime can hold.
    """
    text = text.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        return as_utc(datetime.fromisoformat(text))
    except OverflowError:
        raise ValueError("the time is out of the range of UTC datetimes") from None


def points_between(
    points: Iterable[IntensityPoint], start: datetime, end: datetime
) -> list[IntensityPoint]:
    """The points of ``[start, end)``, one per time (the last one given wins), in time order."""
    in_range = {p.time: p for p in points if start <= p.time < end}
    return sorted(in_range.values(), key=lambda p: p.time)


def fetch_in_windows(
    start: datetime,
    end: datetime,
    window: timedelta,
    fetch: Callable[[datetime, datetime], Iterable[IntensityPoint]],
) -> list[IntensityPoint]:
    """The points of ``[start, end)`` from an API that answers at most ``window`` at a time.

    Args:
        start: the first time wanted (UTC).
        end: the first time not wanted (UTC).
        window: the longest range one request may ask for.
        fetch: one request: the points of ``[window_start, window_end)``.

    Returns:
        As :func:`points_between` of every answer: one point per time, in time order.
    """
    points: list[IntensityPoint] = []
    window_start = start
    while window_start < end:
        window_end = min(window_start + window, end)
        points.extend(fetch(window_start, window_end))
        window_start = window_end
    return points_between(points, start, end)


class HttpProvider:
    """Base of the web providers: one session, timeouts, retries, error translation.

    Args:
        base_url: the API root; each provider has a public default. Credentials in it
            (``user:password@``) are used, and shown only as ``***@`` (:attr:`base_url`,
            reprs, errors) and scrubbed from quoted bodies.
        timeout_s: (connect, read) timeouts in seconds.
        max_retries: retries after the first attempt for 429, 5xx, timeouts and
            connection errors.
        backoff_s: first backoff in seconds; doubled at each retry.
        max_backoff_s: cap of one backoff.
        max_retry_after_s: the longest ``Retry-After`` honoured by waiting; a longer one
            raises :class:`~carbon.errors.QuotaError` at once (a background poll must not
            sleep for an hour).
        sleep: the function that waits (injected by tests).
        session: a ``requests.Session`` to use instead of a new one (closed by
            :meth:`close` only when created here).
    """

    name: ClassVar[str] = "http"
    default_base_url: ClassVar[str] = ""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        timeout_s: tuple[float, float] = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_retry_after_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
        session: requests.Session | None = None,
    ) -> None:
        if max_retries < 0:
            raise CarbonConfigError(f"max_retries: {max_retries!r} is not allowed; use >= 0")
        root = (base_url or self.default_base_url).rstrip("/")
        self._root = Secret(root)
        self._url_credentials = url_secrets(root)
        #: The API root as shown in messages and reprs (credentials masked).
        self.base_url = redact_url(root)
        self.timeout_s = (float(timeout_s[0]), float(timeout_s[1]))
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self._sleep = sleep
        self._owns_session = session is None
        self._session = session if session is not None else self._new_session()

    @staticmethod
    def _new_session() -> requests.Session:
        session = requests.Session()
        adapter = HTTPAdapter(max_retries=0)  # retries are ours: Retry-After, typed errors
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return session

    def close(self) -> None:
        """Close the HTTP session (when this provider created it)."""
        if self._owns_session:
            self._session.close()

    def __enter__(self) -> HttpProvider:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _secrets(self) -> list[Secret]:
        """The credentials to scrub from any text that leaves this object (providers add
        theirs to those of ``base_url``)."""
        return list(self._url_credentials)

    def _scrub(self, text: str, limit: int = BODY_EXCERPT_CHARS) -> str:
        return scrub_excerpt(text, self._secrets(), limit)

    def _request_json(
        self,
        path: str,
        *,
        operation: str,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        auth: tuple[str, str] | None = None,
    ) -> Any:
        """GET ``base_url + path`` and return the decoded JSON body.

        Raises:
            ProviderError: a subclass describing the failure (see :mod:`carbon.errors`).
        """
        url = f"{self._root.reveal()}{path}"
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                response = self._session.get(
                    url,
                    params=params,
                    headers=dict(headers or {}),
                    auth=auth,
                    timeout=self.timeout_s,
                    allow_redirects=False,
                )
            except requests.Timeout as exc:
                failure: ProviderError = ProviderUnavailableError(
                    f"no answer from {path} within the (connect, read) timeouts {self.timeout_s} s",
                    provider=self.name,
                    operation=operation,
                )
                cause: BaseException = exc
            except requests.RequestException as exc:
                failure = ProviderUnavailableError(
                    f"cannot reach {self.base_url} ({type(exc).__name__})",
                    provider=self.name,
                    operation=operation,
                )
                cause = exc
            else:
                logger.debug(
                    "%s %s: GET %s -> HTTP %d", self.name, operation, path, response.status_code
                )
                if response.status_code == 429:
                    retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
                    if last or (retry_after_s or 0.0) > self.max_retry_after_s:
                        raise QuotaError(
                            "rate limited by the provider"
                            + (f"; retry after {retry_after_s:g} s" if retry_after_s else ""),
                            retry_after_s=retry_after_s,
                            provider=self.name,
                            operation=operation,
                            status=429,
                        )
                    wait_s = retry_after_s if retry_after_s is not None else self._backoff(attempt)
                    logger.debug("%s %s: HTTP 429, waiting %.3g s", self.name, operation, wait_s)
                    self._sleep(wait_s)
                    continue
                if response.status_code >= 500:
                    failure = ProviderUnavailableError(
                        f"server error: {self._body_message(response)}",
                        provider=self.name,
                        operation=operation,
                        status=response.status_code,
                    )
                    if last:
                        raise failure
                    logger.debug("%s %s: %s; retrying", self.name, operation, failure)
                    self._sleep(self._backoff(attempt))
                    continue
                if not 200 <= response.status_code < 300:
                    raise self._error_for(response, operation)
                return self._decode(response, operation)
            if last:
                raise failure from cause
            logger.debug("%s %s: %s; retrying", self.name, operation, failure)
            self._sleep(self._backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        return float(min(self.backoff_s * 2**attempt, self.max_backoff_s))

    def _decode(self, response: requests.Response, operation: str) -> Any:
        try:
            return response.json()
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise BadResponseError(
                "the response body is not valid JSON",
                provider=self.name,
                operation=operation,
                status=response.status_code,
            ) from exc

    def _body_message(self, response: requests.Response) -> str:
        """A short description of an error body, scrubbed of every credential before it
        is shortened."""
        try:
            body = response.json()
        except (ValueError, RecursionError):
            return self._scrub(response.text) or self._scrub(response.reason or "") or "no details"
        if isinstance(body, dict):
            parts = [str(body[k]) for k in ("error", "message", "detail") if body.get(k)]
            if parts:
                return self._scrub("; ".join(parts))
        return self._scrub(response.text)

    def _error_for(self, response: requests.Response, operation: str) -> ProviderError:
        """Translate a 3xx/4xx answer; providers refine 403 and 404."""
        status = response.status_code
        message = self._body_message(response)
        kwargs: dict[str, Any] = {"provider": self.name, "operation": operation, "status": status}
        if status in (401, 403):
            return AuthError(f"credentials rejected: {message}", **kwargs)
        if status == 404:
            return NoDataError(f"no data: {message}", **kwargs)
        if 300 <= status < 400:
            return BadResponseError(
                "unexpected redirect (not followed, so credentials stay with this host); "
                "check base_url",
                **kwargs,
            )
        return BadResponseError(f"request refused: {message}", **kwargs)

    def _bad(self, message: str, operation: str) -> BadResponseError:
        """A :class:`BadResponseError` whose message (which may quote the body) is
        scrubbed of every credential."""
        return BadResponseError(self._scrub(message, 400), provider=self.name, operation=operation)

    def _no_data(self, message: str, operation: str) -> NoDataError:
        """A :class:`NoDataError` whose message (which may quote the body) is scrubbed."""
        return NoDataError(self._scrub(message, 400), provider=self.name, operation=operation)


def _retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or an HTTP date); ``None``
    when absent or not a finite wait."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = as_utc(email.utils.parsedate_to_datetime(value))
        except (TypeError, ValueError, OverflowError):
            return None
        seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None
