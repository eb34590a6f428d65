"""Typed fields of JSON that someone else wrote (a lease file in a shared directory).

Each reader takes a parsed JSON object and a key, and returns the value only when it has
exactly the expected type and lies in range; otherwise it raises :class:`ValueError`
naming the key, a short printable rendering of the value, and what is allowed. Booleans
are not integers here, strings are not numbers, ``NaN`` and infinities are refused, and
text must be printable (no terminal escapes reach a log).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "MAX_MHZ",
    "MAX_POWER_W",
    "MAX_TEXT",
    "field",
    "kind_of",
    "parse_json",
    "read_bool",
    "read_clock_lock",
    "read_int",
    "read_optional_int",
    "read_optional_text",
    "read_text",
    "read_watts",
    "show",
]

#: Longest text field accepted.
MAX_TEXT = 256
#: Largest power limit accepted, in watts.
MAX_POWER_W = 100_000.0
#: Largest clock accepted, in MHz.
MAX_MHZ = 100_000


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a lease may hold")


def parse_json(raw: bytes) -> Any:
    """Parse strict UTF-8 JSON (no ``NaN``/``Infinity``).

    Raises:
        ValueError: not UTF-8, not JSON, or nested too deeply, in words.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def kind_of(value: Any) -> str:
    """What a JSON value is, in words (``"an object"``, ``"null"``, ``"a number"``...)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def show(value: Any) -> str:
    """A short, printable rendering of a scalar from a lease (never the whole of a big
    or nested value)."""
    if isinstance(value, (dict, list)):
        return kind_of(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def field(data: dict[str, Any], key: str, prefix: str = "") -> Any:
    """``data[key]``, or a ValueError naming the missing key."""
    if key not in data:
        raise ValueError(f"{prefix}{key}: missing")
    return data[key]


def read_int(data: dict[str, Any], key: str, lo: int, hi: int, prefix: str = "") -> int:
    """An integer in ``lo..hi`` (not a boolean)."""
    value = field(data, key, prefix)
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{prefix}{key}: {show(value)} is not an integer in {lo}..{hi}")
    return value


def read_optional_int(data: dict[str, Any], key: str, prefix: str = "") -> int | None:
    """None or an integer >= 0."""
    value = field(data, key, prefix)
    return None if value is None else read_int(data, key, 0, (1 << 63) - 1, prefix)


def read_text(data: dict[str, Any], key: str, prefix: str = "", max_len: int = MAX_TEXT) -> str:
    """Printable text of 1 to ``max_len`` characters."""
    value = field(data, key, prefix)
    if not isinstance(value, str) or not 0 < len(value) <= max_len or not value.isprintable():
        raise ValueError(
            f"{prefix}{key}: {show(value)} is not printable text of 1 to {max_len} characters"
        )
    return value


def read_optional_text(
    data: dict[str, Any], key: str, prefix: str = "", max_len: int = MAX_TEXT
) -> str | None:
    """None or printable text."""
    return None if field(data, key, prefix) is None else read_text(data, key, prefix, max_len)


def read_bool(data: dict[str, Any], key: str) -> bool:
    """True or false."""
    value = field(data, key)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: {show(value)} is not true or false")
    return value


def read_watts(data: dict[str, Any], key: str) -> float:
    """A finite number of watts in ``(0, MAX_POWER_W]`` (compared, not converted first:
    JSON integers may lie past a float's range; NaN and infinities fail the comparison)."""
    value = field(data, key)
    if type(value) not in (int, float) or not 0 < value <= MAX_POWER_W:
        raise ValueError(f"{key}: {show(value)} is not a number of watts in (0, {MAX_POWER_W:g}]")
    return float(value)


def read_clock_lock(data: dict[str, Any], key: str) -> tuple[int, int] | None:
    """None or ``[min_mhz, max_mhz]`` with ``0 < min_mhz <= max_mhz <= MAX_MHZ``."""
    value = field(data, key)
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(type(v) is not int for v in value)
        or not 0 < value[0] <= value[1] <= MAX_MHZ
    ):
        raise ValueError(
            f"{key}: {show(value)} is not null or [min_mhz, max_mhz] with "
            f"0 < min_mhz <= max_mhz <= {MAX_MHZ}"
        )
    return value[0], value[1]
