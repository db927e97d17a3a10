"""One blocking resource used from abandonable daemon threads: one call at a time, nothing after
close, and the last call out of a closed sink releases the resource."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Guard"]

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

    def close(self) -> None:
        """No call after this one; release now unless a call is still out."""
        with self._state:
            self._closed = True
            busy = self._busy
        if not busy:
            with self._io:
                self._release()
