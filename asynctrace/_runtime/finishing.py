"""Finish once, from any thread: the blocking twin of `Lifecycle.finish_once`, for the fronts
(a Ray client, a rank's logger), which own no event loop.

The rules are the session's: the first call does the work within its own deadline, to its end;
a call from another thread meanwhile waits for that outcome (a shorter deadline of its own
would cut a drain short that another caller asked for whole); every later call returns the
outcome at once. One more case is a thread's own: a call re-entering on the thread that is
finishing (a signal handler that interrupted it) returns what is known now, since waiting there
would wait for itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .lifecycle import State

__all__ = ["FinishOnce"]

T = TypeVar("T")


class FinishOnce(Generic[T]):
    """The finish of one front: `state` is OPEN, then CLOSING while the work runs, then CLOSED."""

    def __init__(self) -> None:
        self.state = State.OPEN
        self.final: T | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._finisher: int | None = None

    @property
    def open(self) -> bool:
        return self.state is State.OPEN

    @property
    def finished(self) -> bool:
        return self.state is State.CLOSED

    def run(self, work: Callable[[], T], now: Callable[[], T]) -> T:
        """`work()` on the first call, its result on every other (see the module's rules); `now()`
        for a call re-entering on the finishing thread. A `work` that raises is final all the
        same: `now()` is kept as its outcome and the error goes to the caller that ran it."""
        me = threading.get_ident()
        with self._lock:
            if self.state is State.CLOSED:
                assert self.final is not None
                return self.final
            first = self.state is State.OPEN
            if first:
                self.state, self._finisher = State.CLOSING, me
        if not first:
            if self._finisher == me:
                return now()
            self._done.wait()
            assert self.final is not None
            return self.final
        try:
            result = work()
        except BaseException:
            self._finished(now())
            raise
        self._finished(result)
        return result

    def _finished(self, result: T) -> None:
        with self._lock:
            self.final, self.state, self._finisher = result, State.CLOSED, None
        self._done.set()
