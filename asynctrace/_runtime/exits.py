"""The one registry of what runs at interpreter exit, in phases, whichever module asks.

Python runs `atexit` hooks last registered, first run. Ray registers its own ``shutdown`` when it
is imported, and a Ray call made after that hook ran cannot reach anything: a driver's client
could not ship, nor its collector be finished. So the registry is one `atexit` hook that moves to
the front each time a hook is added: every phase runs before any exit hook registered before
the newest of them (Ray's, once a Ray client or collector exists). The phases run in order, each
hook in the order it was added; one that raises is logged and the others still run.
"""

from __future__ import annotations

import atexit
import enum
import threading
from collections.abc import Callable
from typing import NamedTuple

from .._security import logger

__all__ = ["Phase", "at_exit"]


class Phase(enum.IntEnum):
    """When a hook runs at exit, earliest first."""

    SHIP = 0  # fronts whose samples go to another process: ship them, or count them lost
    REMOTE = 1  # sessions this process had another one open (a driver's collector): finish them
    OWNED = 2  # fronts that own a session here (a collector in its actor): hand on, then finish it
    SESSIONS = 3  # this process's own sessions: drain the blocking ones, report the async ones


class _Hook(NamedTuple):
    phase: Phase
    order: int
    fn: Callable[[], None]
    what: str


_hooks: list[_Hook] = []
_lock = threading.Lock()


def at_exit(phase: Phase, fn: Callable[[], None], what: str) -> None:
    """Run `fn()` at interpreter exit in `phase`; `what` names it in the log if it raises."""
    with _lock:
        _hooks.append(_Hook(phase, len(_hooks), fn, what))
        # To the front of Python's queue: ahead of every hook registered before this one.
        atexit.unregister(_run)
        atexit.register(_run)


def _run() -> None:
    with _lock:
        hooks = sorted(_hooks)
        _hooks.clear()
    for hook in hooks:
        try:
            hook.fn()
        except Exception as exc:  # best effort on the way out: the next hook still runs
            logger.error("asynctrace: %s at exit failed: %s", hook.what, exc)
