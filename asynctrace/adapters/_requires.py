"""What a framework hook relies on, checked where it hooks in: one clear message when a version moved it.

Each adapter declares its `Framework` (the version it was tested with, and the package that
says which version is installed) and, per object it is given, the `Need`s it relies on: an
attribute or method by dotted path, and its shape (called with so many positional arguments,
a coroutine function, a mapping holding some keys). `gaps` lists what an object lacks;
`report` says it once per hook and gap, naming both versions and what happens instead. The
hooks then leave the trainer as it was (`attach`) or count the batch as dropped ("invalid"),
and training goes on: a version that renamed a hook point never runs silently with nothing
logged, and never raises into training.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._security import logger
from ._hooks import count_invalid

__all__ = ["UNCHANGED", "Framework", "Need", "gaps", "refuse", "report"]

UNCHANGED = "nothing is logged for this trainer, which trains on unchanged"
"""What an `attach` does when the trainer lacks what it wraps."""


@dataclass(frozen=True)
class Framework:
    """A framework as a hook knows it: its name, the version tested, the package that has its version."""

    name: str
    tested: str
    """The version the hook was tested with (``"1.16.0"``), or the commit (``"commit 624b824a898a"``)."""
    package: str | None = None
    """The distribution that reports the installed version; None where it is not installed as one."""

    def installed(self) -> str | None:
        """The installed version, where the framework is a package that says so."""
        if self.package is None:
            return None
        try:
            return importlib.metadata.version(self.package)
        except Exception:  # not installed as a distribution, or its metadata is unreadable
            return None

    def versions(self) -> str:
        """Both versions, as the message names them."""
        installed = self.installed()
        tested = f"{self.name} {self.tested}"
        if installed is None:
            return f"tested with {tested}"
        if installed == self.tested:
            return f"{self.name} {installed}, the version it was tested with"
        return f"{self.name} {installed} is installed, tested with {tested}"


@dataclass(frozen=True)
class Need:
    """One attribute or method a hook relies on, by dotted path from the object it is given."""

    path: str
    """Dotted attributes from the object; "" for the object itself (its `keys`, say)."""
    args: int | None = None
    """When set, a callable that takes this many positional arguments."""
    coroutine: bool = False
    """A coroutine function (awaited by the framework)."""
    keys: tuple[str, ...] = ()
    """Keys the value holds (a dict, or a TensorDict-like object with `keys()`)."""


def _takes(fn: Any, n: int) -> bool:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return True
    try:
        signature.bind(*([None] * n))
    except TypeError:
        return False
    return True


def _problem(value: Any, need: Need, where: str) -> str | None:
    """What is wrong with `value` (`where`, in the message); None when it is as the hook expects."""
    if need.args is not None or need.coroutine:
        if not callable(value):
            return f"{where} is not callable"
        if need.coroutine and not inspect.iscoroutinefunction(value):
            return f"{where} is not a coroutine function"
        if need.args is not None and not _takes(value, need.args):
            plural = "" if need.args == 1 else "s"
            return f"{where} does not take {need.args} positional argument{plural}"
    if need.keys:
        try:
            held = set(value.keys())
        except Exception:
            return f"{where} has no keys (a {type(value).__name__})"
        absent = [key for key in need.keys if key not in held]
        if absent:
            return f"{where} has no {', '.join(repr(k) for k in absent)}"
    return None


def gaps(target: Any, needs: Iterable[Need], name: str) -> list[str]:
    """What `target` (called `name` in the message) lacks of `needs`, one phrase each; [] when nothing."""
    out = []
    for need in needs:
        value = target
        where = f"{name}.{need.path}" if need.path else name
        try:
            for part in need.path.split(".") if need.path else ():
                value = getattr(value, part)
        except AttributeError:
            out.append(f"{where} is missing")
            continue
        except Exception as exc:  # a property that raises: the hook could not read it either
            out.append(f"{where} cannot be read ({type(exc).__name__}: {exc})")
            continue
        problem = _problem(value, need, where)
        if problem is not None:
            out.append(problem)
    return out


_reported: set[tuple[str, tuple[str, ...]]] = set()
_lock = threading.Lock()


def report(framework: Framework, where: str, problems: Sequence[str], outcome: str) -> None:
    """One warning per hook and set of problems: what is missing, both versions, and `outcome`
    (what the hook does instead, and that training goes on)."""
    key = (where, tuple(problems))
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    logger.warning(
        "asynctrace: %s: this hook does not fit the %s it was given (%s): %s; %s",
        where,
        framework.name,
        framework.versions(),
        "; ".join(problems),
        outcome,
    )


def refuse(framework: Framework, where: str, problems: Sequence[str], session: Any, rows: int | None) -> int:
    """A per-call hook's answer to a batch (or trainer) without what it reads: the batch's `rows`
    (at least one) counted as dropped ("invalid"), the problems said once. Returns 0 samples."""
    report(framework, where, problems, "its batches are counted in session.stats().dropped['invalid']")
    count_invalid(session, 1 if rows is None else rows)
    return 0
