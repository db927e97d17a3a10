"""What a forked child lets go of: objects holding resources bound to the process that made them.

A process forked from a trainer (a fork-started DataLoader worker, a helper) gets copies of the
trainer's sessions, spool locks and pipes to the Trackio writer, but none of its threads. Each
such object registers here while it holds something a child must not keep or use, and is told
once, in the child, right after a fork.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

__all__ = ["hold", "release"]

# Each holder's own method to run in a child (held weakly, as the holder itself).
_held: weakref.WeakKeyDictionary[object, weakref.WeakMethod[Callable[[], None]]] = weakref.WeakKeyDictionary()


def hold(obj: object, in_child: Callable[[], None]) -> None:
    """`in_child()`, a method of `obj`, runs in every child forked from now on, until `release`."""
    _held[obj] = weakref.WeakMethod(in_child)


def release(obj: object) -> None:
    _held.pop(obj, None)


def _in_child() -> None:
    holders = [ref() for ref in _held.values()]
    _held.clear()  # the child's copies are not held for its own children
    for in_child in holders:
        if in_child is not None:
            in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
