"""Shutdown hooks: drain a session on SIGTERM/SIGINT and at interpreter exit, within a deadline.

On a signal the hook drains the session, then hands the signal on to the handler that was there
before (restored first, so the hook runs once per signal): a default handler gets a *finished*
session, your own handler a *flushed* one, and an ignored signal only flushes. The table of
cases, and what a second signal does: docs/reliability.md.

A synchronous session (or an async one on another thread) is drained from the signal handler
itself, waiting at most the deadline. An async session on the main thread cannot be waited for
there (the handler runs on the very thread that must do the work), so the drain is scheduled
as a task on its loop and the signal is handed on from that loop when it is done.

Python runs signal handlers on the main thread only, so hooks are installed from there; nothing
runs on SIGKILL, which is what the spool is for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

from .._checks import wait_arg
from .._security import logger
from .exits import Phase, at_exit
from .lifecycle import Closable, Lifecycle, finish_bound

__all__ = ["EXIT_MARGIN", "hand_on", "hook_bound", "install", "runners"]

DEFAULT_TIMEOUT = 10.0
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds past finish()'s own bound that a hook waits for the session's loop thread to answer.
EXIT_MARGIN = 1.0

Handler = Callable[[int, FrameType | None], Any] | int | None


class Runner(Closable, Protocol):
    """A synchronous session's loop thread (see `_sync`)."""

    life: Lifecycle


# Sessions to drain at interpreter exit: every synchronous session (its writer thread is a
# daemon and would otherwise be killed mid-write) and every session with shutdown hooks.
runners: weakref.WeakSet[Runner] = weakref.WeakSet()  # type: ignore[type-var]
_hooked: weakref.WeakSet[Lifecycle] = weakref.WeakSet()
_exit_timeouts: weakref.WeakKeyDictionary[Lifecycle, float] = weakref.WeakKeyDictionary()


def _is_default(handler: Handler) -> bool:
    return handler in (signal.SIG_DFL, signal.default_int_handler)


class _Hooks:
    """The signal handlers installed for one session."""

    def __init__(self, life: Lifecycle, timeout: float, signals: Iterable[int]) -> None:
        self.life = life
        self.timeout = timeout
        self.previous: dict[int, Handler] = {}
        self.busy = False
        self.deferred = 0  # signals taken again later because a lock was held (see _held)
        for signum in signals:
            self.previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Restore the previous handlers (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(self.previous.items()):
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(signum) == self._on_signal:
                    self._restore(signum, previous)
            self.previous.pop(signum, None)

    def _restore(self, signum: int, previous: Handler) -> None:
        self.previous.pop(signum, None)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    # -- the handler ---------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        life = self.life
        # Read once, here: the drain's finish() uninstalls the hooks, which forgets them, and
        # handing on must still reach the handler that was there before (Python's SIGINT
        # handler raising KeyboardInterrupt, not the default action that kills the process).
        previous = self.previous.get(signum, signal.SIG_DFL)
        if not self.busy and life.is_closing():
            self._after_finish(signum, frame, previous)
            return
        if self.busy or not life.is_open():
            self._hand_on(signum, frame, previous)
            return
        off_loop = life.loop_thread != threading.main_thread().ident
        if off_loop and self.deferred < _MAX_DEFERRALS and _held(life):
            # This thread was interrupted holding a lock the drain needs (inside a logging
            # call): waiting here would wait for ourselves. Let it go on and release the lock,
            # and take the signal again in a moment.
            self.deferred += 1
            timer = threading.Timer(_DEFER_S, os.kill, (os.getpid(), signum))
            timer.daemon = True  # a signal taken again must never hold up the exit
            timer.start()
            return
        self.deferred = 0
        self.busy = True
        final = _is_default(previous)
        logger.warning(
            "asynctrace: %s received; %s the session (deadline %.1fs)",
            signal.Signals(signum).name,
            "finishing" if final else "flushing",
            self.timeout,
        )
        if off_loop:
            try:
                _drain_from_outside(life, final, self.timeout)
            finally:
                self.busy = False
            self._hand_on(signum, frame, previous)
            return
        if not life.schedule(
            self._drain_then_hand_on,
            signum,
            final,
            previous,
            otherwise=lambda: self._redeliver(signum, previous),
        ):
            self.busy = False
            self._hand_on(signum, frame, previous)

    def _after_finish(self, signum: int, frame: FrameType | None, previous: Handler) -> None:
        """The session is finishing already: hand the signal on once that finish is done."""
        life = self.life
        self.busy = True
        # A finish with a longer deadline than the hook's is cut short to the hook's.
        life.schedule(life.hurry, self.timeout)
        if life.loop_thread != threading.main_thread().ident:
            try:
                # Within the hook's own bound, whatever deadline that finish was given: the
                # signal is handed on in the time a finish(timeout) of the hook's would take.
                if not life.closed.wait(wait_arg(hook_bound(self.timeout, final=True))):
                    logger.error("asynctrace: the session did not finish in time at shutdown")
            finally:
                self.busy = False
            self._hand_on(signum, frame, previous)
            return
        # This thread runs the finish: it cannot be waited for here.
        life.after_finish.append(lambda: self._redeliver(signum, previous))

    async def _drain_then_hand_on(self, signum: int, final: bool, previous: Handler) -> None:
        try:
            await _drain(self.life, final, self.timeout)
        finally:
            # Re-delivered from the loop's own callback machinery, not from this task, so an
            # exception the previous handler raises (KeyboardInterrupt, SystemExit) leaves the
            # event loop as it would have from the handler itself, instead of landing in the
            # session's task group.
            if not self.life.call_soon(lambda: self._redeliver(signum, previous)):
                self._redeliver(signum, previous)

    def _redeliver(self, signum: int, previous: Handler) -> None:
        self.busy = False
        self._restore(signum, previous)
        signal.raise_signal(signum)

    def _hand_on(self, signum: int, frame: FrameType | None, previous: Handler) -> None:
        self._restore(signum, previous)
        hand_on(signum, frame, previous)


def hand_on(signum: int, frame: FrameType | None, previous: Handler) -> None:
    """Give a signal to the handler that was there before a hook (which the caller restored):
    call it, or deliver the signal again to a default one; an ignored signal goes no further."""
    if previous is None or previous == signal.SIG_IGN:
        return
    if previous == signal.SIG_DFL:
        signal.raise_signal(signum)
        return
    assert callable(previous)
    previous(signum, frame)


# A signal that finds a lock the drain needs held is taken again this much later, at most this
# many times in a row (then the drain is tried anyway, bounded by its deadline).
_DEFER_S = 0.05
_MAX_DEFERRALS = 40


def _held(life: Lifecycle) -> bool:
    """True when a lock the drain needs stays held for a while: most likely by the thread the
    signal interrupted (the loop's thread holds these for milliseconds at most)."""
    locks = life.locks()
    give_up = time.monotonic() + 0.2
    while any(lock.locked() for lock in locks):
        if time.monotonic() > give_up:
            return True
        time.sleep(0.005)
    return False


async def _drain(life: Lifecycle, final: bool, timeout: float) -> None:
    try:
        if final:
            await life.finish(timeout)
        else:
            await life.flush(timeout)
    except Exception as exc:  # the signal must be handed on whatever happened here
        logger.error("asynctrace: draining the session on shutdown failed: %s", exc)


def hook_bound(timeout: float, *, final: bool) -> float:
    """The longest a hook with deadline `timeout` holds a signal (or the exit) before handing it on:
    what finish(timeout) (or flush(timeout)) may take, and a margin for the loop thread to answer."""
    return (finish_bound(timeout) if final else timeout) + EXIT_MARGIN


def _drain_from_outside(life: Lifecycle, final: bool, timeout: float) -> bool:
    """Drain a session whose loop runs on another thread, within `hook_bound(timeout)` in all."""
    give_up = time.monotonic() + hook_bound(timeout, final=final)
    done = threading.Event()

    async def job() -> None:
        try:
            await _drain(life, final, timeout)
        finally:
            done.set()

    if not life.schedule(job, otherwise=done.set):
        return False
    if not done.wait(wait_arg(give_up - time.monotonic())):
        logger.error("asynctrace: the session did not drain within %.1fs at shutdown", timeout)
        return False
    if final and life.runner is not None:
        # The session is finished: this only stops its loop thread, in what is left of the bound.
        life.runner.close(timeout, bound=max(give_up - time.monotonic(), 0.1))
    return True


def install(life: Lifecycle, timeout: float, signals: Iterable[int]) -> Callable[[], None]:
    """See `asynctrace.install_shutdown_hooks`; `timeout` is checked already."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "install_shutdown_hooks must be called from the main thread (Python runs signal "
            "handlers there only)"
        )
    if life.hooks is not None:
        life.hooks.uninstall()
    hooks = _Hooks(life, float(timeout), signals)
    life.hooks = hooks
    _hooked.add(life)
    _exit_timeouts[life] = float(timeout)

    def uninstall() -> None:
        hooks.uninstall()
        if life.hooks is hooks:
            life.hooks = None
        _hooked.discard(life)

    return uninstall


def install_for_session(life: Lifecycle) -> None:
    """``shutdown_hooks=True``: every hook on the main thread; elsewhere only the exit hook."""
    if threading.current_thread() is threading.main_thread():
        install(life, DEFAULT_TIMEOUT, DEFAULT_SIGNALS)
        return
    logger.warning(
        "asynctrace: shutdown_hooks=True but the session was opened off the main thread; "
        "only the exit hook is installed (Python runs signal handlers on the main thread)"
    )
    _hooked.add(life)


def _at_exit() -> None:
    # A synchronous session left open at interpreter exit is drained with its own deadline, so
    # traces are not lost and the writer thread (a daemon) cannot hang the exit.
    for runner in list(runners):
        try:
            life = runner.life
            runner.close(_exit_timeouts.get(life, life.finish_timeout))
        except Exception as exc:  # pragma: no cover - best effort at exit
            logger.error("asynctrace: finishing a session at exit failed: %s", exc)
    for life in list(_hooked):
        if not life.is_open() or life.runner is not None:
            continue
        # An async session still open at exit: its loop is gone unless it ran on another thread.
        loop_thread = life.loop_thread
        alive = any(t.ident == loop_thread and t.is_alive() for t in threading.enumerate())
        if alive and loop_thread != threading.main_thread().ident:
            _drain_from_outside(life, True, _exit_timeouts.get(life, DEFAULT_TIMEOUT))
            continue
        spooled = life.spooled()
        held = f"; {spooled} of its records are in the spool" if spooled is not None else ""
        logger.warning(
            "asynctrace: session %s was still open at exit with %d samples pending%s",
            life.name,
            life.stats().pending,
            held,
        )


at_exit(Phase.SESSIONS, _at_exit, "finishing the open sessions")
