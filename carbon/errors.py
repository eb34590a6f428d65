"""The exception tree of ``carbon``.

Every error the package raises derives from :class:`CarbonError`; HTTP status codes,
timeouts and malformed bodies are translated where they happen, with the provider and
the operation attached (never a token)::

    CarbonError
    ├── CarbonConfigError               bad configuration; lists every problem found at once
    │   └── TraceError                  a carbon-intensity trace file cannot be used
    ├── AccountingError                 an interval or value given to the ledger is invalid
    └── ProviderError                   a provider could not answer (``provider`` attached)
        ├── AuthError                   401/403 on credentials: missing, wrong or expired
        ├── QuotaError                  429 (``retry_after_s`` attached when sent)
        ├── RegionNotInPlanError        the account's plan does not cover the region/signal
        │                               (or endpoint: an Electricity Maps 401 once the
        │                               token was accepted)
        ├── NoDataError                 the provider answered but has no data for the request
        ├── BadResponseError            unparseable body or unexpected shape
        └── ProviderUnavailableError    5xx, timeouts, connection errors
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AccountingError",
    "AuthError",
    "BadResponseError",
    "CarbonConfigError",
    "CarbonError",
    "NoDataError",
    "ProviderError",
    "ProviderUnavailableError",
    "QuotaError",
    "RegionNotInPlanError",
    "TraceError",
]


class CarbonError(Exception):
    """Base class of every exception raised by ``carbon``."""


class CarbonConfigError(CarbonError, ValueError):
    """Invalid carbon configuration.

    Args:
        problems: one message per problem, each naming the key, the bad value and what is
            allowed. All of them are reported together so a user fixes the file once.
        source: where the configuration came from (a file path, ``"python"``).
    """

    def __init__(self, problems: str | Iterable[str], source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            message = f"invalid carbon configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} problems in the carbon configuration{where}:\n{lines}"
        super().__init__(message)


class AccountingError(CarbonError, ValueError):
    """An interval or a value given to the carbon ledger is invalid."""


class TraceError(CarbonConfigError):
    """A carbon-intensity trace (CSV) is missing, lacks the needed columns or is malformed."""


class ProviderError(CarbonError):
    """A carbon-intensity provider failed to answer.

    Args:
        message: what failed, in words (never containing a credential).
        provider: the provider's name (``"electricitymaps"``, ``"watttime"``...).
        operation: what was asked (``"latest"``, ``"forecast"``, ``"login"``...).
        status: the HTTP status code, when there was a response.
    """

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        operation: str | None = None,
        status: int | None = None,
    ) -> None:
        self.provider = provider
        self.operation = operation
        self.status = status
        prefix = f"{provider}: " if provider else ""
        details = []
        if operation:
            details.append(f"during {operation}")
        if status is not None:
            details.append(f"HTTP {status}")
        suffix = f" ({', '.join(details)})" if details else ""
        super().__init__(f"{prefix}{message}{suffix}")


class AuthError(ProviderError):
    """The credentials are missing, wrong or expired (HTTP 401, or 403 on login)."""


class QuotaError(ProviderError):
    """The provider rate-limited the client (HTTP 429) and retries were exhausted.

    Args:
        message: what failed.
        retry_after_s: the wait the server asked for, when it sent ``Retry-After``.
        **kwargs: as for :class:`ProviderError`.
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        provider: str | None = None,
        operation: str | None = None,
        status: int | None = None,
    ) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message, provider=provider, operation=operation, status=status)


class RegionNotInPlanError(ProviderError):
    """The account's plan does not include this region, signal or endpoint (e.g. WattTime
    403; Electricity Maps 403, or 401 once a request with the token has succeeded)."""


class NoDataError(ProviderError):
    """The provider answered but holds no data for the zone and time asked."""


class BadResponseError(ProviderError):
    """The response body is not valid JSON/CSV or lacks the expected fields."""


class ProviderUnavailableError(ProviderError):
    """The provider is unreachable: 5xx answers, timeouts or connection failures."""
