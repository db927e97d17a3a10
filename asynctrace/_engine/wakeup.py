"""`Signal`: the one level-triggered wake-up the writer's dispatcher and lanes wait on."""

from __future__ import annotations

import anyio

__all__ = ["Signal"]


class Signal:
    """A level-triggered wake-up for one waiting task (event-loop thread only)."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._flag = False

    def set(self) -> None:
        """Wake the waiter, now or at its next wait."""
        if not self._flag:  # set already: the event is set too, until the waiter takes it
            self._flag = True
            self._event.set()

    async def wait(self, timeout: float | None) -> None:
        """Wait until set or for `timeout` seconds (None: no limit); then the signal is clear."""
        if not self._flag:
            with anyio.move_on_after(timeout):
                await self._event.wait()
        self._flag = False
        if self._event.is_set():
            self._event = anyio.Event()
