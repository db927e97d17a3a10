"""Argument checks shared by every constructor and logging call: one clear ValueError each."""

from __future__ import annotations

import threading
from typing import Any

__all__ = [
    "check_bool",
    "check_int",
    "check_seconds",
    "check_step",
    "check_timeout",
    "check_type",
    "wait_arg",
]


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> None:
    """`value` is an int (not a bool) of at least `minimum`, or None when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """`value` is a bool: a string such as "no" would read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_type(name: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """`value` is None or an instance of `kind` (described as `what`)."""
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{name} must be {what} or None, got {type(value).__name__}")


def check_seconds(name: str, value: Any, *, allow_none: bool = False) -> None:
    """`value` is a positive number of seconds, or None when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """A wait's timeout as a float: None (no limit) or seconds >= 0 (inf: no limit).

    Anything with `__float__` counts (numpy scalars, a 0-d tensor); a bool, a string or a
    negative or NaN value is a ValueError naming `name`.
    """
    # Checked up front: a bad value found only when a wait begins (a full buffer, a deadline
    # being computed) would fail half-way, in a call that must always complete.
    if value is None:
        return None
    if not isinstance(value, bool) and hasattr(type(value), "__float__"):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            pass
        else:
            if seconds >= 0:
                return seconds
    raise ValueError(f"{name} must be None or a number of seconds >= 0, got {value!r}")


def check_step(step: Any, split: Any = "train") -> None:
    """A logging call's step (an int >= 0) and split (a non-empty str)."""
    check_int("step", step, minimum=0)
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty str, got {split!r}")


def wait_arg(seconds: float) -> float | None:
    """`seconds` for a blocking wait: None (no limit) where it is more than a wait accepts."""
    return None if seconds >= threading.TIMEOUT_MAX else seconds
