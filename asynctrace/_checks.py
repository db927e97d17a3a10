"""Argument checks shared by every constructor and logging call: one clear ValueError each."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["check_int", "check_seconds", "check_step", "wait_arg"]


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> None:
    """`value` is an int (not a bool) of at least `minimum`, or None when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")


def check_seconds(name: str, value: Any, *, allow_none: bool = False) -> None:
    """`value` is a positive number of seconds, or None when allowed."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def check_step(step: Any, split: Any = "train") -> None:
    """A logging call's step (an int >= 0) and split (a non-empty str)."""
    check_int("step", step, minimum=0)
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty str, got {split!r}")


def wait_arg(seconds: float) -> float | None:
    """`seconds` for a blocking wait: None (no limit) where it is more than a wait accepts."""
    return None if seconds >= threading.TIMEOUT_MAX else seconds
