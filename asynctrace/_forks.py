"""What a forked child lets go of: objects holding resources bound to the process that made them.

A process forked from a trainer (a fork-started DataLoader worker, a helper) gets copies of the
trainer's sessions, spool locks and pipes to the Trackio writer, but none of its threads. Each
such object registers here while it holds something a child must not keep or use, and is told
once, in the child, right after a fork.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["hold", "release"]


class _Holder(Protocol):
    def _after_fork_in_child(self) -> None: ...


_held: weakref.WeakSet[_Holder] = weakref.WeakSet()


def hold(obj: _Holder) -> None:
    """`obj._after_fork_in_child()` runs in every child forked from now on, until `release`."""
    _held.add(obj)


def release(obj: _Holder) -> None:
    _held.discard(obj)


def _in_child() -> None:
    holders = list(_held)
    _held.clear()  # the child's copies are not held for its own children
    for obj in holders:
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
