"""A session's life as its blocking form and its shutdown hooks see it: its state, its event
loop (reached from any thread or a signal handler), and how a finish under way is cut short.

The session owns one; `_sync` and `shutdown` use nothing else of it, so neither depends on
the session itself.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._stats import SessionStats
from ..exceptions import AsyncTraceError, SessionClosedError
from .abandon import threadsafe_caller

__all__ = ["STOP_GRACE", "Job", "Lifecycle", "State", "close_grace", "finish_bound"]

# Seconds finish() gives the writer to stop once cancelled before it names what holds it up.
STOP_GRACE = 2.0


def close_grace(budget: float) -> float:
    """The least time finish(budget) gives its sinks to close, however long the drain took, so
    that a slow drain never skips finishing the runs they opened."""
    return min(budget, 5.0)


def finish_bound(budget: float) -> float:
    """The longest finish(budget) takes: the drain, the grace for a writer that ignores its
    cancel, and the sinks' close."""
    return budget + STOP_GRACE + close_grace(budget)


# A coroutine function run as a task of the session (see Lifecycle.schedule).
Job = Callable[[], Coroutine[Any, Any, None]]


class State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FORKED = "forked"  # a copy in a process forked from the session's own


class Uninstallable(Protocol):
    def uninstall(self) -> None: ...


class Closable(Protocol):
    def close(self, timeout: float, *, bound: float | None = None) -> SessionStats: ...


@dataclass(eq=False, repr=False, kw_only=True)
class Lifecycle:
    """State, loop and finish of one session. `finish`, `flush` and `stats` are the session's;
    `locks` returns the locks a drain needs (see `_shutdown._held`)."""

    name: str
    finish: Callable[[float | None], Coroutine[Any, Any, SessionStats]]
    flush: Callable[[float | None], Coroutine[Any, Any, bool]]
    stats: Callable[[], SessionStats]
    locks: Callable[[], Sequence[threading.Lock]]
    finish_timeout: float
    spooled: Callable[[], int | None]  # records held in the spool, None without one
    state: State = field(default=State.UNOPENED, init=False)
    pid: int = field(default_factory=os.getpid, init=False)
    loop_thread: int | None = field(default=None, init=False)
    _call: Callable[[Callable[[], None]], object] | None = field(default=None, init=False)
    _tg: anyio.abc.TaskGroup | None = field(default=None, init=False)
    # Jobs other threads and signal handlers start in the session's task group.
    _jobs: MemoryObjectSendStream[Job] | None = field(default=None, init=False)
    hooks: Uninstallable | None = field(default=None, init=False)  # the shutdown hooks installed for it
    runner: Closable | None = field(default=None, init=False)  # its loop thread, when used in blocking form
    # Set once finish() is done, for waiters on other threads (a signal handler).
    closed: threading.Event = field(default_factory=threading.Event, init=False)
    final: SessionStats | None = field(default=None, init=False)
    # Run on the loop, through its own callback machinery, once finish() is done.
    after_finish: list[Callable[[], None]] = field(default_factory=list, init=False)
    # The drain of a finish() under way, and its budget and deadline, which `hurry` may cut.
    drain_scope: anyio.CancelScope | None = field(default=None, init=False)
    budget: float = field(default=0.0, init=False)
    deadline: float = field(default=0.0, init=False)
    # Set once a finish() is under way, for a second finish() to wait on.
    _finishing: anyio.Event | None = field(default=None, init=False)

    # -- state ---------------------------------------------------------------------------

    def is_open(self) -> bool:
        return self.state is State.OPEN

    def is_closing(self) -> bool:
        return self.state is State.CLOSING

    def is_forked(self) -> bool:
        return self.state is State.FORKED

    def check_usable(self) -> None:
        """What even log_samples_nowait refuses (it counts samples after finish as "closed")."""
        if self.state is State.UNOPENED:
            raise SessionClosedError("the session is not open yet; use `async with` or `with`")
        if self.state is State.FORKED:
            raise SessionClosedError(
                f"this session belongs to process {self.pid}, which this process was forked "
                "from; a forked child cannot log through it (open a session in the child, or "
                "see docs/distributed.md to send samples to one session from many processes)"
            )

    def check_unopened(self) -> None:
        if self.state is not State.UNOPENED:
            raise SessionClosedError(f"a TraceSession can be opened once; this one is {self.state.value}")

    def check_open(self) -> None:
        self.check_usable()
        if self.state is not State.OPEN:
            raise SessionClosedError("the session is finished; it accepts no more samples")

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def check_loop_thread(self, what: str) -> None:
        # Its waits are on the session's own event loop: awaited from another thread's loop
        # they would break that loop's primitives (and the writer with them) instead of waiting.
        if self.loop_thread is not None and not self.on_loop_thread():
            raise AsyncTraceError(
                f"{what}() must be awaited on the event loop that opened the session; from another "
                "thread or event loop, use the session's blocking form (`with TraceSession(...)`), "
                "whose methods may be called from any thread"
            )

    # -- the loop ------------------------------------------------------------------------

    async def open(self, writer: Callable[..., Coroutine[Any, Any, None]]) -> anyio.abc.TaskGroup:
        """Start `writer` (a task that reports when it started) in a new task group, and open."""
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(writer)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise
        await self.opened(tg)
        return tg

    async def opened(self, tg: anyio.abc.TaskGroup) -> None:
        """The session's writer runs in `tg` on the current event loop: it is open now."""
        self.loop_thread = threading.get_ident()
        self._call = threadsafe_caller()
        self._tg = tg
        self._jobs, jobs = anyio.create_memory_object_stream[Job](math.inf)
        tg.start_soon(self._run_jobs, jobs)
        self.pid = os.getpid()
        self.state = State.OPEN

    async def _run_jobs(self, jobs: MemoryObjectReceiveStream[Job]) -> None:
        # Starting a task needs a task context (anyio detects the event loop from it), which a
        # loop callback scheduled by another thread or a signal handler does not have; this
        # task starts such jobs for them. It ends when finish() closes the stream.
        assert self._tg is not None
        async with jobs:
            async for job in jobs:
                self._tg.start_soon(job)

    def call_soon(self, fn: Callable[[], None]) -> bool:
        """Run `fn` on the session's event loop soon, from any thread; False when that loop is gone."""
        call = self._call
        if call is None:
            return False
        try:
            call(fn)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def schedule(
        self,
        fn: Callable[..., Coroutine[Any, Any, None]],
        *args: Any,
        otherwise: Callable[[], None] | None = None,
    ) -> bool:
        """Start `fn(*args)` as a task of the session, from any thread or a signal handler.

        False when the loop is gone; `otherwise` runs (on the loop) if the session turns out to
        be finishing by the time the task would start.
        """
        job = functools.partial(fn, *args)

        def submit() -> None:
            jobs = self._jobs
            try:
                if jobs is None:
                    raise anyio.ClosedResourceError
                jobs.send_nowait(job)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                if otherwise is not None:
                    otherwise()

        return self.call_soon(submit)

    # -- finishing -----------------------------------------------------------------------

    async def finish_once(
        self, timeout: float | None, work: Callable[[], Coroutine[Any, Any, SessionStats]]
    ) -> SessionStats:
        """finish(timeout): `work` drains and closes by the deadline, shielded, once; a second
        call waits for the first's outcome within its own bound; later calls return it."""
        if self.state is State.CLOSED:
            assert self.final is not None
            return self.final
        if self.state is State.UNOPENED:
            raise SessionClosedError("the session was never opened; use `async with` or `with`")
        if self.state is State.FORKED:
            return self.stats()  # the parent process finishes it
        self.check_loop_thread("finish")
        budget = self.finish_timeout if timeout is None else float(timeout)
        if self._finishing is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(finish_bound(budget)):
                await self._finishing.wait()
            return self.final if self.final is not None else self.stats()
        self._finishing = anyio.Event()
        with anyio.CancelScope(shield=True):
            self.finishing(budget, anyio.current_time() + budget)
            stats = await work()
            self._finishing.set()
            self.finished(stats)
        return stats

    def finishing(self, budget: float, deadline: float) -> None:
        self.state = State.CLOSING
        self.budget, self.deadline = budget, deadline

    async def hurry(self, timeout: float) -> None:
        """Cut the drain of a finish() under way to end within `timeout` seconds from now, and its
        close grace to match (a shutdown hook with a shorter deadline). A job: `schedule` it."""
        scope = self.drain_scope
        deadline = anyio.current_time() + timeout
        if scope is not None and deadline < self.deadline:
            self.budget = min(self.budget, timeout)
            self.deadline = deadline
            scope.deadline = deadline

    def finished(self, stats: SessionStats) -> None:
        """finish() is done: state CLOSED, waiters told, callbacks run on the loop."""
        self.final = stats
        self.state = State.CLOSED
        if self._jobs is not None:
            self._jobs.close()
        self.closed.set()
        # After the state is CLOSED: a signal handler that saw CLOSING has added its
        # callback by now, and one that runs later sees CLOSED and hands on by itself.
        while self.after_finish:
            callback = self.after_finish.pop(0)
            if not self.call_soon(callback):
                callback()
