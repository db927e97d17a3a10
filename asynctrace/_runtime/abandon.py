"""Calls that a deadline can walk away from: blocking work on daemon threads, and coroutines
run as tasks of their own.

Two things can outlive a cancel: a blocking call in a thread (a write to a FIFO nobody reads, a
hung mount) and a coroutine that ignores its cancellation. `run_sync_daemon` runs the first on a
daemon thread (anyio's worker threads are not daemons when the loop runs on the main thread, so
an abandoned call there would keep the interpreter from exiting). `spawn_detached` runs the
second as a task outside every task group, and `call_abandonable` awaits one such call and can
stop waiting for it; the session's writer runs this way as a whole.

A coroutine that never yields (blocking work inside an ``async`` method) cannot be walked away
from on its own event loop: nothing else on that loop runs until it returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import anyio
import sniffio

__all__ = [
    "Backlog",
    "call_abandonable",
    "run_sync_daemon",
    "spawn_detached",
    "threadsafe_caller",
    "wait_first",
]

T = TypeVar("T")

# An idle daemon worker exits after this many seconds without work.
IDLE_S = 10.0


class _Worker:
    """A daemon thread that runs jobs one at a time and goes back to `_idle` between them."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="asynctrace-io", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with _lock:
                    if self in _idle:
                        _idle.remove(self)
                        return
                # Taken from `_idle` just now: its job is on the way.
                continue
            job()
            del job
            with _lock:
                _idle.append(self)


_lock = threading.Lock()
_idle: list[_Worker] = []


def _forget_workers() -> None:
    # A forked child has none of its parent's threads: jobs handed to them would never run.
    global _lock
    _lock = threading.Lock()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _submit(job: Callable[[], None]) -> None:
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        try:
            worker = _Worker()
        except RuntimeError:  # no new threads at interpreter shutdown (Python 3.12+): run inline
            job()
            return
    worker.jobs.put(job)


def threadsafe_caller() -> Callable[[Callable[[], None]], object]:
    """A non-blocking way for another thread to run a callback on the current event loop."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe


class _Outcome(Generic[T]):
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def unwrap(self) -> T:
        if self.error is not None:
            try:
                raise self.error
            finally:
                self.error = None  # no reference cycle through the traceback
        return self.value  # type: ignore[return-value]


class Backlog:
    """Caps how many calls of one owner (a sink) may be running or waiting in daemon threads,
    abandoned ones included: a file that blocks for good then costs a few threads, not one more
    per attempt, and the calls past the cap fail at once (and are retried like any failure)."""

    def __init__(self, what: str, limit: int = 8) -> None:
        self.what = what
        self.limit = limit
        self.calls = 0
        self._lock = threading.Lock()

    # A sink is sent to another process (a Ray collector) before it is opened: the calls it
    # counts stay here, and its lock is made anew there.
    def __getstate__(self) -> dict[str, object]:
        return {"what": self.what, "limit": self.limit}

    def __setstate__(self, state: dict[str, object]) -> None:
        vars(self).update(state, calls=0)
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self.calls >= self.limit:
                raise RuntimeError(f"{self.what}: {self.calls} earlier calls are still blocked")
            self.calls += 1

    def leave(self) -> None:
        with self._lock:
            self.calls -= 1


async def run_sync_daemon(fn: Callable[..., T], *args: Any, backlog: Backlog | None = None) -> T:
    """`fn(*args)` on a daemon thread; cancelling the caller abandons the call at once.

    An abandoned call goes on in its thread until it returns; it never keeps the interpreter
    from exiting. With `backlog`, the call counts against that owner's cap.
    """
    outcome: _Outcome[T] = _Outcome()
    call_soon = threadsafe_caller()
    if backlog is not None:
        backlog.enter()

    def job() -> None:
        try:
            outcome.value = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            outcome.error = exc
        finally:
            if backlog is not None:
                backlog.leave()
        # An event loop that is gone has nobody waiting for this call any more.
        with contextlib.suppress(Exception):
            call_soon(outcome.done.set)

    _submit(job)
    await outcome.done.wait()
    return outcome.unwrap()


# asyncio keeps only weak references to tasks: these keep detached calls alive until they end.
_tasks: set[Any] = set()


def spawn_detached(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start `fn()` as a task outside every task group (asyncio) or as a system task (trio).

    `fn` must catch its own exceptions: nobody awaits it. The event loop's end still deals with
    it: `asyncio.run` cancels it (that cancel reaches through shielded scopes) and trio.run waits
    for it.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, context=contextvars.copy_context())
        return
    import asyncio

    task = asyncio.get_running_loop().create_task(fn())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def wait_first(*events: anyio.Event | None, timeout: float | None = None) -> None:
    """Wait until one of `events` is set (None ones never are), at most `timeout` seconds."""
    waited = [e for e in events if e is not None]
    with anyio.move_on_after(timeout):
        if len(waited) == 1:
            await waited[0].wait()
            return
        async with anyio.create_task_group() as tg:

            async def first(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            for event in waited:
                tg.start_soon(first, event)


async def call_abandonable(fn: Callable[[], Awaitable[T]], *, grace: float | None = None) -> T:
    """Await `fn()` run as a task of its own, which the caller can leave behind.

    Cancelling the caller cancels the call and waits for it to end, as awaiting it directly
    would; but `grace` seconds after the cancel, the caller stops waiting and its cancellation
    goes on, leaving a call that ignores its cancel running alone.
    """
    outcome: _Outcome[T] = _Outcome()
    scope = anyio.CancelScope()

    async def run() -> None:
        try:
            with scope:
                outcome.value = await fn()
        except BaseException as exc:  # handed to the awaiting task (none, once abandoned)
            outcome.error = exc
        finally:
            outcome.done.set()

    spawn_detached(run)
    try:
        await outcome.done.wait()
    except BaseException:
        # Cancelled: the call is cancelled too, and waited for as long as it may be.
        scope.cancel()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace):
                await outcome.done.wait()
        raise
    return outcome.unwrap()
