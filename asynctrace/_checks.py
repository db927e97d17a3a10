"""Argument checks shared by every constructor and logging call: one clear ValueError each."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ._security import check_name, check_text, shown

__all__ = [
    "MAX_STEP",
    "check_bool",
    "check_encoding",
    "check_flags",
    "check_ints",
    "check_project_run",
    "check_int",
    "check_seconds",
    "check_split",
    "check_step",
    "check_text",
    "check_timeout",
    "checked_metrics",
    "check_type",
    "int64_or_none",
    "wait_arg",
]

# The largest step a sink can store: Trackio keeps steps in an SQLite INTEGER (64-bit signed).
MAX_STEP = 2**63 - 1


def check_int(
    name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, allow_none: bool = False
) -> None:
    """`value` is an int (not a bool) of at least `minimum` (and at most `maximum`), or None when allowed."""
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        if maximum is not None:
            what += f" and <= {maximum}"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {shown(value)}")


def check_ints(**values: Any) -> None:
    """Every value is a positive int."""
    for name, value in values.items():
        check_int(name, value)


def check_flags(**flags: Any) -> None:
    """Every flag is a bool."""
    for name, flag in flags.items():
        check_bool(name, flag)


def check_project_run(project: Any, run: Any) -> None:
    """`project`, and `run` unless None, are non-empty names every sink can store."""
    for name, value in (("project", project), ("run", run)):
        if value is None and name == "run":
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"{name} must be a non-empty str{' or None' * (name == 'run')}, got {shown(value)}"
            )
        check_name(name, value)


def check_encoding(on_invalid: Any, redact: Any) -> None:
    """The options of every front that validates and encodes samples."""
    if on_invalid not in ("raise", "skip"):
        raise ValueError(f"on_invalid must be one of ('raise', 'skip'), got {shown(on_invalid)}")
    if redact is not None and not callable(redact):
        raise ValueError("redact must be a callable taking and returning a Sample")


def check_bool(name: str, value: Any) -> None:
    """`value` is a bool: a string such as "no" would read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {shown(value)}")


def check_type(name: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """`value` is None or an instance of `kind` (described as `what`)."""
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{name} must be {what} or None, got {type(value).__name__}")


def check_seconds(name: str, value: Any, *, allow_none: bool = False) -> None:
    """`value` is a positive number of seconds, or None when allowed."""
    if value is None and allow_none:
        return
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0:
        try:
            float(value)  # an int too large for a float (10**400) would fail where it is used
            return
        except OverflowError:
            pass
    raise ValueError(f"{name} must be a positive number of seconds, got {shown(value)}")


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """A wait's timeout as a float: None (no limit) or seconds >= 0 (inf: no limit).

    Anything with `__float__` counts (numpy scalars, a 0-d tensor); a bool, a string, a
    negative or NaN value, or one that no float can hold (``10**400``, a tensor of several
    elements) is a ValueError naming `name`.
    """
    # Checked up front: a bad value found only when a wait begins (a full buffer, a deadline
    # being computed) would fail half-way, in a call that must always complete.
    if value is None:
        return None
    if not isinstance(value, bool) and hasattr(type(value), "__float__"):
        try:
            seconds = float(value)
        except Exception:  # OverflowError, or whatever a caller's __float__ raises
            pass
        else:
            if seconds >= 0:
                return seconds
    raise ValueError(f"{name} must be None or a number of seconds >= 0, got {shown(value)}")


def check_step(step: Any, split: Any = "train") -> None:
    """A logging call's step (an int from 0 to `MAX_STEP`) and split (a non-empty str a sink
    can store): refused here, not by the sink's write, where it would fail its whole batch."""
    check_int("step", step, minimum=0, maximum=MAX_STEP)
    check_split(split)


def check_split(split: Any) -> None:
    """A split: a non-empty str that UTF-8 can hold."""
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty str, got {shown(split)}")
    check_text("split", split)


def int64_or_none(value: Any) -> int | None:
    """`value` if it is an int (not a bool) that a 64-bit signed column holds, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not -MAX_STEP - 1 <= value <= MAX_STEP:
        return None
    return value


def wait_arg(seconds: float) -> float | None:
    """`seconds` for a blocking wait: None (no limit) where it is more than a wait accepts."""
    return None if seconds >= threading.TIMEOUT_MAX else seconds


def checked_metrics(metrics: Any) -> dict[str, float]:
    """`metrics` as a dict of str to float, or a ValueError naming what is wrong."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping of str to number, got {type(metrics).__name__}")
    clean: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise ValueError(f"metrics: key {shown(k)} is not a str")
        check_text("metrics: key", k)
        try:
            clean[k] = float(v)
        except Exception:  # OverflowError (10**400) or a caller's __float__ failing
            # Not chained: float()'s error quotes the value (a string) unscrubbed.
            raise ValueError(
                f"metrics[{shown(k)}]: expected a number a float can hold, got {type(v).__name__}"
            ) from None
    return clean
