"""Blocking work used from abandonable daemon threads: one call at a time, nothing after close.

`Guard` is for a sink's files, which the last call out of a closed sink releases; `Serial` for a
tracker's client, whose calls are also sorted into those worth retrying and those not."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

from .._runtime.abandon import Backlog, run_sync_daemon
from ..exceptions import PermanentSinkError

__all__ = ["Guard", "Serial"]

_T = TypeVar("_T")


class Guard:
    """Serialises a sink's file work and decides who releases the files at close.

    A timeout abandons a call stuck on a blocking file (a FIFO, a hung mount) without stopping
    its thread; `close` must not wait for it. `busy` counts calls started or waiting: `close`
    releases at once when none is, otherwise the last call to finish does.
    """

    def __init__(self, name: str, release: Callable[[], None], quiet: type[BaseException]) -> None:
        self._name = name
        self._release = release
        self._quiet = quiet
        self._io = threading.Lock()
        self._state = threading.Lock()
        self._busy = 0
        self._closed = False

    def __call__(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run `fn(*args)` on the resource, one call at a time."""
        with self._state:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._busy += 1
        try:
            with self._io:
                if self._closed:
                    # Queued behind a call that was given up on while the sink closed meanwhile:
                    # nothing may be written after close.
                    raise RuntimeError(f"{self._name} is closed")
                return fn(*args)
        finally:
            with self._state:
                self._busy -= 1
                last = self._closed and not self._busy
            if last:
                # This call was given up on (the sink closed meanwhile): nobody awaits an error.
                with contextlib.suppress(self._quiet):
                    self._release()

    # A sink is sent to another process (a Ray collector) before it is opened: its locks are
    # made anew there, and only an idle guard can be sent.
    def __getstate__(self) -> dict[str, object]:
        if self._busy:
            raise TypeError(f"{self._name} cannot be sent to another process while a call is out")
        return {k: v for k, v in vars(self).items() if k not in ("_io", "_state")}

    def __setstate__(self, state: dict[str, object]) -> None:
        vars(self).update(state)
        self._io = threading.Lock()
        self._state = threading.Lock()

    def close(self) -> None:
        """No call after this one; release now unless a call is still out."""
        with self._state:
            self._closed = True
            busy = self._busy
        if not busy:
            with self._io:
                self._release()


class Serial:
    """A tracker client's blocking calls on abandonable daemon threads: one at a time, none after close.

    A deadline walks away from a call stuck on a stalled server; the calls behind it wait for the
    lock in their own threads. `permanent(exc)` says why an error is one that retrying cannot fix
    (None when retrying may help); such an error is raised as `PermanentSinkError`.
    """

    def __init__(self, name: str, permanent: Callable[[Exception], str | None]) -> None:
        self._name = name
        self._permanent = permanent
        self._lock = threading.Lock()
        self._closed = False
        self._backlog = Backlog(name)

    # Sent to another process before its sink is opened (see `Guard`): the lock is made anew.
    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` after the calls before it, unless the sink closed meanwhile."""
        return await run_sync_daemon(self._call, fn, *args, backlog=self._backlog)

    def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            try:
                return fn(*args)
            except PermanentSinkError:
                raise
            except Exception as exc:
                why = self._permanent(exc)
                if why is not None:
                    raise PermanentSinkError(why) from exc
                raise

    async def close(self, last: Callable[[], None]) -> None:
        """Run `last` once, as the final call: behind a call still stuck, in a thread of its own
        that the session's close deadline can walk away from (it runs once the stuck call returns)."""
        await run_sync_daemon(self._close, last)

    def _close(self, last: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last()
