"""Waiting for the buffer, the one way: a `Room` subscription, never polling. A submission
waits here for room (``on_full="block"``) or for a holding sampler's selection to take it, and
flush() for earlier submissions to be queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import anyio

from .._runtime.lifecycle import Lifecycle
from .buffer import Buffer, Waiting

__all__ = ["Waits"]


class Waits:
    """The waits of one session's intake (`intake.Intake`), on its loop or in other threads."""

    def __init__(self, buffer: Buffer, life: Lifecycle, wake_writer: Callable[[], None]) -> None:
        self.buffer = buffer
        self.life = life
        self.wake_writer = wake_writer

    async def until_changed(self, attempt: Callable[[], bool]) -> None:
        """On the loop thread: call `attempt` until it returns True, waiting for the buffer to
        change between tries."""
        life = self.life
        while True:
            event = anyio.Event()

            def wake(event: anyio.Event = event) -> None:
                if life.on_loop_thread():
                    event.set()
                else:
                    life.call_soon(event.set)

            self.buffer.room.subscribe(wake)
            if attempt():
                return
            await event.wait()

    def admit_waiting(self, waiting: Waiting) -> Waiting:
        """Offer what `waiting` holds again; returns what waits on (the same, or plain records)."""
        adm = self.buffer.admit_waiting(waiting)
        if adm.wake:
            self.wake_writer()
        # What a sampler passed, waiting for the queue, goes on as plain records.
        return adm.waiting if adm.waiting is not None and adm.waiting is not waiting else waiting

    async def wait_for_room(self, waiting: Waiting, timeout: float | None) -> int:
        """Admit `waiting` as room frees up; returns how many will not be queued after all
        (given up, or refused by the cap when they were offered at last)."""
        ticket = self.buffer.take_ticket()
        current = [waiting]

        def attempt() -> bool:
            current[0] = self.admit_waiting(current[0])
            return not len(current[0])

        try:
            with anyio.move_on_after(timeout):
                await self.until_changed(attempt)
                return current[0].lost
            self.buffer.give_up_waiting(current[0], "queue_full")
            return current[0].lost
        except BaseException:
            if len(current[0]):
                self.buffer.give_up_waiting(current[0], "cancelled")
            raise
        finally:
            self.buffer.return_ticket(ticket)

    def wait_blocking(
        self, waiting: Waiting, timeout: float | None, cancelled: threading.Event | None
    ) -> int:
        """`wait_for_room` for a thread other than the loop's: blocks it."""
        buf = self.buffer
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            event = threading.Event()
            buf.room.subscribe(event.set)
            if cancelled is not None and cancelled.is_set():
                buf.give_up_waiting(waiting, "cancelled")
                break
            waiting = self.admit_waiting(waiting)
            if not len(waiting):
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                buf.give_up_waiting(waiting, "queue_full")
                break
            event.wait(left)
        return waiting.lost

    async def until_queued(self, ticket: int | None, timeout: float | None) -> bool:
        """Wait until the submissions numbered `ticket` or earlier (None: every one) are queued or
        given up; False when `timeout` passed first."""
        with anyio.move_on_after(timeout):
            await self.until_changed(lambda: not self.buffer.tickets_upto(ticket))
            return True
        return False
