"""``argparse`` types shared by the ``lightning-energy`` command and the demo script.

Each refuses a bad value with a message naming the value and what is allowed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_in", "int_in", "non_empty", "positive_int"]


def positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1, with a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; use an integer >= 1")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """``argparse`` type: an integer in ``[low, high]``, with a message naming the range.

    Example:
        >>> int_in(0, 2**32 - 1)("7")
        7
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{value} is not allowed; use an integer from {low} to {high}"
            )
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def float_in(low: float, high: float, *, low_inclusive: bool = True) -> Callable[[str], float]:
    """``argparse`` type: a finite number in ``[low, high]`` (``(low, high]`` when
    ``low_inclusive`` is false), with a message naming the range; NaN and infinities are
    refused.

    Example:
        >>> float_in(0, 600, low_inclusive=False)("2.5")
        2.5
    """
    above = f">= {low:g}" if low_inclusive else f"> {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number; use a number {above} and <= {high:g}"
            ) from None
        inside = low <= value if low_inclusive else low < value
        if not (math.isfinite(value) and inside and value <= high):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not allowed; use a number {above} and <= {high:g}"
            )
        return value

    parse.__name__ = "number"
    return parse


def non_empty(text: str) -> str:
    """``argparse`` type: a non-empty path or name (``''`` would mean the current folder)."""
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give a non-empty path")
    return text
