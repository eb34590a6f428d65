"""The ``carbon:`` configuration section: provider, region, credentials, polling, policy.

Built from YAML (:func:`load_carbon_config`), a mapping (:meth:`CarbonConfig.from_mapping`)
or Python keywords (``CarbonConfig(provider="uk", region="13")``). Every problem is
reported at once in one :class:`~carbon.errors.CarbonConfigError`, each naming the key,
the bad value and what is allowed. No region is ever guessed: it is required for every
provider except ``constant``. Credentials are read from environment variables whose
*names* are configured; their values are never printed.

Example:
    >>> cfg = CarbonConfig.from_mapping({"provider": "trace", "region": "DE",
    ...                                  "deadline": "36h", "poll_interval_s": 60})
    >>> cfg.deadline
    datetime.timedelta(days=1, seconds=43200)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from carbon.errors import CarbonConfigError
from carbon.monitor import CarbonMonitor
from carbon.providers import electricitymaps, uk, watttime
from carbon.providers.base import CarbonProvider, Secret, redact_url
from carbon.providers.constant import ConstantProvider
from carbon.providers.trace import SHIPPED_TRACES, TraceProvider, load_trace
from carbon.types import as_utc

__all__ = [
    "CarbonConfig",
    "build_monitor",
    "build_provider",
    "load_carbon_config",
    "parse_deadline",
]

PROVIDERS = ("electricitymaps", "watttime", "uk", "trace", "constant")
POLICIES = ("static", "threshold", "forecast")
FALLBACKS = ("constant", "daily")
EMISSION_FACTORS = ("direct", "lifecycle")
#: The emission factor behind the values of the providers where it cannot be chosen: the
#: UK API's factors count nothing for wind, solar, hydro and nuclear (operational, direct
#: emissions); WattTime serves marginal operating emission rates; a constant is whatever
#: the configuration says it is.
FIXED_EMISSION_FACTORS = {"uk": "direct", "watttime": "marginal", "constant": "unspecified"}
#: The forecast asked for at each poll by default: the longest any provider gives (72 h).
DEFAULT_FORECAST_HORIZON_S = 72 * 3600.0
FORECASTERS = ("perfect", "daily")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_KEYS = ("token_env", "username_env", "password_env")
_NOT_SHOWN = "(not shown: it looks like a credential, not the NAME of a variable)"
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([wdhms])", re.IGNORECASE)
_DURATION_FULL = re.compile(r"^(\s*\d+(?:\.\d+)?\s*[wdhms]\s*)+$", re.IGNORECASE)
_ISO_DURATION = re.compile(
    r"^P(?:(?P<w>\d+(?:\.\d+)?)W)?(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)
_UNIT_S = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}

#: The longest deadline duration accepted: a year (a leap one).
MAX_DEADLINE = timedelta(days=366)

#: Keys that only mean something for some providers.
_PROVIDER_KEYS: dict[str, tuple[str, ...]] = {
    "token_env": ("electricitymaps",),
    "api_version": ("electricitymaps",),
    "username_env": ("watttime",),
    "password_env": ("watttime",),
    "emission_factor": ("electricitymaps", "trace"),
    "time_col": ("trace",),
    "value_col": ("trace",),
    "forecaster": ("trace",),
    "constant_g_per_kwh": ("constant",),
}
_DEFAULT_ENV = {
    "token_env": "ELECTRICITYMAPS_TOKEN",
    "username_env": "WATTTIME_USER",
    "password_env": "WATTTIME_PASSWORD",
}


def parse_deadline(value: object) -> datetime | timedelta:
    """Parse a deadline: an absolute time or a duration from the job's start.

    Args:
        value: a timezone-aware ``datetime`` or ISO 8601 time with an offset
            (``"2025-06-01T18:00:00Z"``), a ``timedelta``, a duration such as ``"36h"``,
            ``"2d 4h"``, ``"90m"``, or an ISO 8601 duration (``"PT36H"``, ``"P2DT4H"``).
            A duration is at most :data:`MAX_DEADLINE` (366 days).

    Returns:
        A UTC ``datetime`` or a positive ``timedelta``.

    Raises:
        ValueError: with the reason, if the value is neither.
    """
    try:
        result = _parse_deadline_value(value)
    except OverflowError:
        raise ValueError(_TOO_FAR) from None
    if isinstance(result, timedelta) and result <= timedelta(0):
        raise ValueError("a duration must be positive")
    if isinstance(result, timedelta) and result > MAX_DEADLINE:
        raise ValueError(_TOO_FAR)
    return result


_TOO_FAR = "allowed: a duration of at most 366 days ('8784h') or a time in years 1 to 9999"


def _parse_deadline_value(value: object) -> datetime | timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("a time needs a UTC offset or 'Z'")
        return as_utc(value)
    if isinstance(value, date):
        raise ValueError("a date needs a time and a UTC offset (e.g. '2025-06-01T18:00:00Z')")
    if isinstance(value, str) and value.strip():
        return _parse_deadline_text(value.strip())
    raise ValueError("expected a time or a duration")


def _parse_deadline_text(text: str) -> datetime | timedelta:
    iso = _ISO_DURATION.match(text)
    if iso and text.upper() not in ("P", "PT") and any(iso.groupdict().values()):
        parts = {k: float(v) for k, v in iso.groupdict().items() if v}
        return _duration(sum(_UNIT_S[k] * v for k, v in parts.items()))
    if _DURATION_FULL.match(text):
        return _duration(
            sum(float(n) * _UNIT_S[u.lower()] for n, u in _DURATION_PART.findall(text))
        )
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise ValueError(
            "expected an ISO 8601 time with offset ('2025-06-01T18:00:00Z') or a duration "
            "('36h', '2d 4h', 'PT36H')"
        ) from None
    if moment.tzinfo is None:
        raise ValueError("a time needs a UTC offset or 'Z'")
    return as_utc(moment)


def _duration(seconds: float) -> timedelta:
    """``seconds`` as a duration; beyond :data:`MAX_DEADLINE` is refused, not overflowed."""
    if not seconds <= MAX_DEADLINE.total_seconds():
        raise OverflowError(seconds)
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class CarbonConfig:
    """Validated settings of the carbon monitor, its provider and the pacing policy.

    Attributes:
        provider: ``electricitymaps`` | ``watttime`` | ``uk`` | ``trace`` | ``constant``.
        region: zone / region / postcode outward code / ``"lat,lon"`` as the provider
            needs; for ``trace`` a shipped trace name (``CISO``, ``DE``, ``FR``) or a CSV
            path. Required except for ``constant``.
        token_env: environment variable holding the Electricity Maps token.
        username_env: environment variable holding the WattTime username.
        password_env: environment variable holding the WattTime password.
        base_url: the provider's API root (default: its public URL; for Electricity Maps
            the root of one API version, e.g. ``https://proxy:8443/v4``).
        api_version: Electricity Maps only: ``v4`` or ``v3``; by default the version
            ``base_url`` ends with, else ``v4``.
        emission_factor: ``direct`` or ``lifecycle`` (Electricity Maps, traces); what
            reports state is :attr:`emission_factor_reported`.
        poll_interval_s: seconds between polls (> 0).
        max_staleness_s: serve the last good value this long during an outage
            (>= ``poll_interval_s``).
        fallback: ``constant`` or ``daily`` (a daily profile of the values seen).
        fallback_g_per_kwh: the constant fallback (>= 0).
        forecast_horizon_s: forecast fetched at each poll, seconds ahead (>= 0; by
            default 72 h, the longest a provider gives: Electricity Maps v4 72 h, UK 48 h).
        constant_g_per_kwh: the value of the ``constant`` provider (default:
            ``fallback_g_per_kwh``).
        time_col: trace time column (detected when unset).
        value_col: trace intensity column (detected when unset).
        forecaster: trace forecast, ``perfect`` (the trace's future) or ``daily``.
        policy: pacing policy, ``static`` | ``threshold`` | ``forecast``.
        deadline: finish by this UTC time, or within this duration of the start (a
            ``datetime`` with an offset or a ``timedelta``; :meth:`from_mapping` also reads
            text such as ``"36h"``).
        max_slowdown: alternatively, at most this factor slower than full speed (>= 1).
        allow_pause: whether the policy may pause training in dirty hours.
        source: where the configuration came from (a file path, ``"python"``).

    Raises:
        CarbonConfigError: listing every problem, when built with invalid values.
    """

    provider: str
    region: str | None = None
    token_env: str | None = None
    username_env: str | None = None
    password_env: str | None = None
    base_url: str | None = None
    api_version: str | None = None
    emission_factor: str = "direct"
    poll_interval_s: float = 900.0
    max_staleness_s: float = 7200.0
    fallback: str = "constant"
    fallback_g_per_kwh: float = 400.0
    forecast_horizon_s: float = DEFAULT_FORECAST_HORIZON_S
    constant_g_per_kwh: float | None = None
    time_col: str | None = None
    value_col: str | None = None
    forecaster: str = "perfect"
    policy: str = "forecast"
    deadline: datetime | timedelta | None = None
    max_slowdown: float | None = None
    allow_pause: bool = False
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise CarbonConfigError(problems, self.source)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._shown_items())
        return f"CarbonConfig({shown})"

    def _shown_items(self) -> list[tuple[str, Any]]:
        """Field names and values, with the credentials of ``base_url`` masked."""
        items = [(f.name, getattr(self, f.name)) for f in fields(self)]
        return [(k, redact_url(v) if k == "base_url" and v else v) for k, v in items]

    @property
    def emission_factor_reported(self) -> str:
        """The emission factor behind the intensities this configuration yields, as every
        report and summary states it: ``emission_factor`` for Electricity Maps and traces,
        ``direct`` for the UK API, ``marginal`` for WattTime, ``unspecified`` for a
        constant. Values of different factors are not comparable (one Danish hour: 75 g
        life-cycle, 20 g direct)."""
        return FIXED_EMISSION_FACTORS.get(self.provider, self.emission_factor)

    @property
    def electricitymaps_api_version(self) -> str:
        """The Electricity Maps API version spoken: ``api_version``, else the version
        ``base_url`` ends with, else ``v4``."""
        return electricitymaps.resolve_api_version(self.api_version, self.base_url)[0]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str | None = None) -> CarbonConfig:
        """Build from the ``carbon:`` section of a YAML file (or any mapping).

        Relative trace paths are taken relative to the directory of ``source`` when it
        is a file.

        Args:
            mapping: the section's keys and values.
            source: where it came from, quoted in errors.

        Returns:
            The validated configuration.

        Raises:
            CarbonConfigError: listing every problem at once.
        """
        if not isinstance(mapping, Mapping):
            raise CarbonConfigError(
                f"carbon: expected a mapping of keys to values; got {type(mapping).__name__}",
                source,
            )
        allowed = [f.name for f in fields(cls) if f.name != "source"]
        problems = [
            f"{key}: unknown key; allowed keys: {', '.join(allowed)}"
            for key in mapping
            if key not in allowed
        ]
        values = {k: v for k, v in mapping.items() if k in allowed}
        if "provider" not in values:
            problems.append(f"provider: missing; allowed: {', '.join(PROVIDERS)}")
        deadline = values.get("deadline")
        if deadline is not None:
            try:
                values["deadline"] = parse_deadline(deadline)
            except ValueError as exc:
                problems.append(f"deadline: {deadline!r} is not valid: {exc}")
                values.pop("deadline")
        region = values.get("region")
        if (
            values.get("provider") == "trace"
            and isinstance(region, str)
            and region.upper() not in SHIPPED_TRACES
            and source is not None
            and not Path(region).is_absolute()
            and Path(source).is_file()
        ):
            values["region"] = str(Path(source).parent / region)
        elif (
            values.get("provider") == "uk"
            and isinstance(region, int)
            and not isinstance(region, bool)
        ):
            values["region"] = str(region)  # a UK region id written as a YAML number
        try:
            config = cls(**values, source=source)
        except CarbonConfigError as exc:
            problems.extend(exc.problems)
        except TypeError as exc:  # pragma: no cover - every key is checked above
            problems.append(str(exc))
        if problems:
            raise CarbonConfigError(problems, source)
        return config

    def to_mapping(self) -> dict[str, Any]:
        """The section as plain YAML data (round-trips through :meth:`from_mapping`).

        Credentials never appear: only the names of the variables that hold them, and
        ``base_url`` with any ``user:password@`` masked as ``***@`` (put proxy credentials
        in the environment, e.g. ``HTTPS_PROXY``, not in a file).
        """
        out: dict[str, Any] = {}
        for name, value in self._shown_items():
            if name == "source" or value is None:
                continue
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, timedelta):
                value = f"{value.total_seconds():g}s"
            out[name] = value
        return out

    def token(self) -> Secret | None:
        """The Electricity Maps token from ``token_env`` (``None`` for other providers).

        Raises:
            CarbonConfigError: if the variable is not set.
        """
        if self.provider != "electricitymaps":
            return None
        return Secret(
            _require_env(self.token_env or _DEFAULT_ENV["token_env"], "token_env", self.source)
        )

    def watttime_credentials(self) -> tuple[str, Secret] | None:
        """WattTime ``(username, password)`` from the environment (``None`` otherwise).

        Raises:
            CarbonConfigError: if a variable is not set.
        """
        if self.provider != "watttime":
            return None
        user_env = self.username_env or _DEFAULT_ENV["username_env"]
        password_env = self.password_env or _DEFAULT_ENV["password_env"]
        problems = []
        user = password = ""
        try:
            user = _require_env(user_env, "username_env", self.source)
        except CarbonConfigError as exc:
            problems.extend(exc.problems)
        try:
            password = _require_env(password_env, "password_env", self.source)
        except CarbonConfigError as exc:
            problems.extend(exc.problems)
        if problems:
            raise CarbonConfigError(problems, self.source)
        return user, Secret(password)


def _reads_like_env_name(value: object) -> bool:
    """Whether a ``*_env`` value reads like a variable name rather than a pasted
    credential: letters, digits and ``_`` in one case (``EM_TOKEN``, ``em_token``), at
    most 64 characters and 4 digits. Only such values are ever quoted in a message."""
    return (
        isinstance(value, str)
        and len(value) <= 64
        and _ENV_NAME.match(value) is not None
        and (value.isupper() or value.islower() or not any(ch.isalpha() for ch in value))
        and sum(ch.isdigit() for ch in value) <= 4
    )


def _shown_env_name(value: object) -> str:
    """A ``*_env`` value as quoted in messages: itself when it reads like a variable
    name, never when it may be the credential."""
    return repr(value) if _reads_like_env_name(value) else _NOT_SHOWN


def _env_problem(name: str, key: str) -> str | None:
    if os.environ.get(name):
        return None
    if not _reads_like_env_name(name):
        return (
            f"{key}: no environment variable of that name is set, and the value "
            f"{_NOT_SHOWN[1:-1]}; allowed: the NAME of a variable holding the credential "
            "(e.g. EM_TOKEN), set in the environment"
        )
    return (
        f"{key}: the environment variable {name!r} is not set or empty; set it to the "
        "credential (its value is never printed) or name another variable"
    )


def _require_env(name: str, key: str, source: str | None) -> str:
    problem = _env_problem(name, key)
    if problem:
        raise CarbonConfigError(problem, source)
    return os.environ[name]


def _validate(c: CarbonConfig) -> list[str]:
    """Every problem of a configuration, each naming the key, value and what is allowed."""
    problems: list[str] = []

    def choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not allowed; allowed: {', '.join(allowed)}")

    def number(key: str, value: object, minimum: float, strict: bool) -> bool:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and -_MAX_NUMBER <= value <= _MAX_NUMBER
            and (value > minimum if strict else value >= minimum)
        )
        if not ok:
            rel = ">" if strict else ">="
            problems.append(
                f"{key}: {_shown(value)} is not allowed; allowed: a finite number {rel} {minimum:g}"
            )
        return ok

    choice("provider", c.provider, PROVIDERS)
    _validate_region(c, problems)
    for key, providers in _PROVIDER_KEYS.items():
        value = getattr(c, key)
        default = next(f.default for f in fields(c) if f.name == key)
        if value != default and c.provider in PROVIDERS and c.provider not in providers:
            shown = _shown_env_name(value) if key in _ENV_KEYS else repr(value)
            problems.append(
                f"{key}: {shown} is not used by provider {c.provider!r}; "
                f"it applies to: {', '.join(providers)}"
            )
    for key in _ENV_KEYS:
        value = getattr(c, key)
        if value is not None and not (isinstance(value, str) and _ENV_NAME.match(value)):
            problems.append(
                f"{key}: {_shown_env_name(value)} is not allowed; allowed: the NAME of an "
                "environment variable (letters, digits, '_'), not the credential itself"
            )
    env_keys = {"electricitymaps": ("token_env",), "watttime": ("username_env", "password_env")}
    for key in env_keys.get(c.provider, ()) if isinstance(c.provider, str) else ():
        env_problem = _env_problem(getattr(c, key) or _DEFAULT_ENV[key], key)
        if env_problem and not _mentions(problems, key):
            problems.append(env_problem)
    if c.base_url is not None and not (
        isinstance(c.base_url, str) and c.base_url.startswith(("http://", "https://"))
    ):
        shown = repr(redact_url(c.base_url)) if isinstance(c.base_url, str) else repr(c.base_url)
        problems.append(f"base_url: {shown} is not allowed; allowed: an http:// or https:// URL")
    if c.provider == "electricitymaps" and isinstance(c.base_url, (str, type(None))):
        api_problem = electricitymaps.resolve_api_version(c.api_version, c.base_url)[1]
        if api_problem:
            problems.append(api_problem)
    choice("emission_factor", c.emission_factor, EMISSION_FACTORS)
    poll_ok = number("poll_interval_s", c.poll_interval_s, 0, strict=True)
    staleness_ok = number("max_staleness_s", c.max_staleness_s, 0, strict=False)
    if staleness_ok and poll_ok and c.max_staleness_s < c.poll_interval_s:
        # Name the key the user set: a default staleness means the poll interval is off.
        if c.max_staleness_s == next(f.default for f in fields(c) if f.name == "max_staleness_s"):
            problems.append(
                f"poll_interval_s: {c.poll_interval_s!r} is not allowed; allowed: a number "
                f"<= max_staleness_s ({c.max_staleness_s!r})"
            )
        else:
            problems.append(
                f"max_staleness_s: {c.max_staleness_s!r} is not allowed; allowed: a number "
                f">= poll_interval_s ({c.poll_interval_s!r})"
            )
    choice("fallback", c.fallback, FALLBACKS)
    number("fallback_g_per_kwh", c.fallback_g_per_kwh, 0, strict=False)
    number("forecast_horizon_s", c.forecast_horizon_s, 0, strict=False)
    if c.constant_g_per_kwh is not None:
        number("constant_g_per_kwh", c.constant_g_per_kwh, 0, strict=False)
    for key in ("time_col", "value_col"):
        value = getattr(c, key)
        if value is not None and not (isinstance(value, str) and value):
            problems.append(f"{key}: {value!r} is not allowed; allowed: a column name")
    choice("forecaster", c.forecaster, FORECASTERS)
    choice("policy", c.policy, POLICIES)
    if c.deadline is not None and not isinstance(c.deadline, (datetime, timedelta)):
        problems.append(
            f"deadline: {c.deadline!r} is not allowed; allowed: a datetime with a UTC offset "
            "or a timedelta (CarbonConfig.from_mapping also reads '36h' or an ISO 8601 time)"
        )
    elif isinstance(c.deadline, datetime) and c.deadline.tzinfo is None:
        problems.append(f"deadline: {c.deadline!r} is not valid: a time needs a UTC offset")
    elif isinstance(c.deadline, timedelta) and c.deadline <= timedelta(0):
        problems.append(f"deadline: {c.deadline!r} is not valid: a duration must be positive")
    elif isinstance(c.deadline, timedelta) and c.deadline > MAX_DEADLINE:
        problems.append(f"deadline: {c.deadline!r} is not valid: {_TOO_FAR}")
    if c.max_slowdown is not None:
        number("max_slowdown", c.max_slowdown, 1, strict=False)
        if c.deadline is not None:
            problems.append(
                f"max_slowdown: {c.max_slowdown!r} together with deadline: "
                f"{c.deadline!r}; allowed: one of them, not both"
            )
    if not isinstance(c.allow_pause, bool):
        problems.append(f"allow_pause: {c.allow_pause!r} is not allowed; allowed: true, false")
    return problems


#: The largest magnitude a number may have (the largest finite float); NaN fails the test.
_MAX_NUMBER = sys.float_info.max


def _shown(value: object) -> str:
    """``repr(value)`` cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mentions(problems: list[str], key: str) -> bool:
    """Whether a problem about ``key`` was already recorded."""
    return any(p.startswith(f"{key}:") for p in problems)


def _validate_region(c: CarbonConfig, problems: list[str]) -> None:
    region = c.region
    if c.provider == "constant":
        if region is not None and not isinstance(region, str):
            problems.append(f"region: {region!r} is not allowed; allowed: a label")
        return
    if c.provider not in PROVIDERS:
        return
    if region is None or (isinstance(region, str) and not region.strip()):
        problems.append(
            f"region: missing; provider {c.provider!r} needs one (no region is guessed): "
            + _REGION_HELP[c.provider]
        )
        return
    if not isinstance(region, str):
        problems.append(f"region: {region!r} is not allowed; allowed: {_REGION_HELP[c.provider]}")
        return
    if c.provider == "trace":
        if region.upper() not in SHIPPED_TRACES and not Path(region).is_file():
            problems.append(
                f"region: {region!r} is not allowed for provider 'trace'; allowed: "
                f"{_REGION_HELP['trace']} (no such file)"
            )
        return
    validator: Callable[[str], str | None] = {
        "electricitymaps": electricitymaps.validate_zone,
        "watttime": watttime.validate_region,
        "uk": uk.validate_region,
    }[c.provider]
    problem = validator(region)
    if problem:
        problems.append(
            f"region: {region!r} is not allowed for provider {c.provider!r}; allowed: {problem}"
        )


_REGION_HELP = {
    "electricitymaps": "a zone key such as 'DE' or 'US-CAL-CISO', or 'lat,lon'",
    "watttime": "a region such as 'CAISO_NORTH', or 'lat,lon'",
    "uk": "'national', a region id 1-17, or a postcode outward code such as 'EN2'",
    "trace": f"a shipped trace ({', '.join(SHIPPED_TRACES)}) or the path of a CSV file",
}


def load_carbon_config(path: str | Path) -> CarbonConfig:
    """Read the ``carbon:`` section of a YAML file.

    Args:
        path: the YAML file.

    Returns:
        The validated configuration (``source`` is the path).

    Raises:
        CarbonConfigError: if the file cannot be read or parsed, has no ``carbon:``
            section, or the section has problems (all listed).
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CarbonConfigError(f"cannot read the file: {exc.strerror or exc}", source) from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(exc, "problem", None)
        detail = f": {what}" if what else ""
        raise CarbonConfigError(f"not valid YAML{where}{detail}", source) from exc
    if not isinstance(document, Mapping) or "carbon" not in document:
        raise CarbonConfigError("no 'carbon:' section in the file", source)
    section = document["carbon"]
    return CarbonConfig.from_mapping(section if section is not None else {}, source=source)


def build_provider(
    config: CarbonConfig, now: Callable[[], datetime] | None = None, **http: Any
) -> CarbonProvider:
    """Create the provider a configuration describes.

    Args:
        config: the configuration.
        now: the current time for providers that use one (trace replay, constant,
            history/forecast ranges); the wall clock by default.
        **http: extra options for web providers (``timeout_s``, ``max_retries``,
            ``sleep``...).

    Returns:
        A provider (web providers own an HTTP session: call ``close()`` when done).

    Raises:
        CarbonConfigError: if a credential variable is unset, or a trace is unusable.
    """
    if config.base_url is not None:
        http["base_url"] = config.base_url
    if config.provider == "electricitymaps":
        token = config.token()
        assert token is not None and config.region is not None
        return electricitymaps.ElectricityMapsProvider(
            config.region,
            token,
            api_version="v3" if config.electricitymaps_api_version == "v3" else "v4",
            emission_factor="lifecycle" if config.emission_factor == "lifecycle" else "direct",
            now=now,
            **http,
        )
    if config.provider == "watttime":
        credentials = config.watttime_credentials()
        assert credentials is not None and config.region is not None
        return watttime.WattTimeProvider(config.region, credentials[0], credentials[1], **http)
    if config.provider == "uk":
        assert config.region is not None
        return uk.UKCarbonIntensityProvider(config.region, now=now, **http)
    if config.provider == "trace":
        assert config.region is not None
        series = load_trace(
            config.region,
            time_col=config.time_col,
            value_col=config.value_col,
            emission_factor="lifecycle" if config.emission_factor == "lifecycle" else "direct",
        )
        return TraceProvider(
            series,
            now=now,
            forecast_horizon_s=config.forecast_horizon_s or DEFAULT_FORECAST_HORIZON_S,
            forecaster="daily" if config.forecaster == "daily" else "perfect",
        )
    value = config.constant_g_per_kwh
    return ConstantProvider(
        config.fallback_g_per_kwh if value is None else value,
        region=config.region or "constant",
        now=now,
    )


def build_monitor(
    config: CarbonConfig,
    clock: Callable[[], float] | None = None,
    now: Callable[[], datetime] | None = None,
    **http: Any,
) -> CarbonMonitor:
    """Create a (not yet started) monitor and its provider from a configuration.

    Give a simulated job's clock as ``clock`` (epoch seconds) or ``now`` (datetimes);
    the other is derived from it so the provider and the monitor agree on the time.

    Args:
        config: the configuration.
        clock: seconds since the epoch.
        now: the current time.
        **http: extra options for web providers.

    Returns:
        The monitor; call ``start()`` or use it as a context manager.

    Raises:
        CarbonConfigError: as :func:`build_provider`.
    """
    if clock is not None and now is None:
        tick = clock

        def now_from_clock() -> datetime:
            return datetime.fromtimestamp(tick(), tz=timezone.utc)

        now = now_from_clock
    elif now is not None and clock is None:
        current = now

        def clock_from_now() -> float:
            return as_utc(current()).timestamp()

        clock = clock_from_now
    provider = build_provider(config, now=now, **http)
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    return CarbonMonitor(
        provider,
        poll_interval_s=config.poll_interval_s,
        max_staleness_s=config.max_staleness_s,
        fallback="daily" if config.fallback == "daily" else "constant",
        fallback_g_per_kwh=config.fallback_g_per_kwh,
        forecast_horizon_s=config.forecast_horizon_s,
        **kwargs,
    )
