"""The check of a number read from outside: a file, a checkpoint, a store row.

JSON allows integers of any size, and Python reads ``1`` followed by 400 zeros as an exact
``int``; ``float()`` and ``math.isfinite()`` of it raise ``OverflowError``, not
``ValueError``. :func:`is_finite` compares ranges instead, so such a value is refused like
any other bad number.
"""

from __future__ import annotations

import numbers
import sys
from typing import TypeGuard, cast

__all__ = ["FLOAT_MAX", "is_finite"]

#: The largest finite float; a number beyond it cannot be held as one.
FLOAT_MAX = sys.float_info.max


def is_finite(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a real number (numpy's too) that a float holds finite: not a
    bool, NaN, an infinity or an integer beyond any float.

    Example:
        >>> is_finite(1.5), is_finite(10**400), is_finite(float("nan")), is_finite(True)
        (True, False, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    # Compared as they are: float(value) itself overflows for an integer beyond any float.
    return -FLOAT_MAX <= cast(float, value) <= FLOAT_MAX
