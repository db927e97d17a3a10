"""Sessions a hook opens itself when given a project name instead of a session, so that a hook
line in a framework's loop needs no setup: the first call opens one, later calls reuse it."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .._security import logger
from .._sync import SyncTraceSession

if TYPE_CHECKING:
    from .._session import TraceSession

__all__ = [
    "FAILED",
    "finish_after",
    "plain_name",
    "session_for",
    "start_trainer_session",
    "trainer_session",
]


_open: dict[tuple[str, str], SyncTraceSession] = {}
_failed: set[tuple[str, str]] = set()
_lock = threading.Lock()


def session_for(
    target: TraceSession | SyncTraceSession | str, *, on_full: Literal["block", "drop_newest"], where: str
) -> TraceSession | SyncTraceSession | None:
    """`target` itself, or the process's session for the project it names; None if it cannot open.

    The session is finished at interpreter exit, as every started synchronous session is.
    Opening never raises into training: a failure is logged once per project and the hook
    logs nothing (there is no session to count the rows in).
    """
    if not isinstance(target, str):
        return target
    key = (target, on_full)
    with _lock:
        session = _open.get(key)
        if session is not None or key in _failed:
            return session
        try:
            from .._session import TraceSession

            session = TraceSession(target, on_full=on_full).start()
        except Exception as exc:  # telemetry must never stop training
            _failed.add(key)
            logger.warning("asynctrace: %s: could not open a session for project %r: %s", where, target, exc)
            return None
        _open[key] = session
        return session


# Where a trainer-bound hook keeps its session, and what it keeps there when opening one failed.
TRAINER_ATTR = "asynctrace_session"
FAILED = object()
_trainer_lock = threading.Lock()


def plain_name(name: Any) -> str | None:
    """A framework's project or run name as a Trackio name: path separators and controls become "-"."""
    if name is None:
        return None
    text = "".join("-" if c in "/\\" or ord(c) < 32 or ord(c) == 127 else c for c in str(name)).strip()
    return None if text in ("", ".", "..") else text


def start_trainer_session(trainer: Any, project: str, run: str | None, **kwargs: Any) -> SyncTraceSession:
    """A blocking session for `trainer` (defaults: 64 traces per step, best and worst by reward),
    stored on it; drained on SIGTERM/SIGINT when opened on the main thread, finished at exit."""
    from .._session import TraceSession

    kwargs.setdefault("max_traces_per_step", 64)
    kwargs.setdefault("sampler", "top_bottom")
    kwargs.setdefault("shutdown_hooks", threading.current_thread() is threading.main_thread())
    # Off the main thread no signal handler can be installed; every blocking session is
    # finished at exit all the same (`_runtime/shutdown.py`).
    session = TraceSession(project, run, **kwargs).start()
    setattr(trainer, TRAINER_ATTR, session)
    return session


def trainer_session(trainer: Any, open_session: Callable[[Any], Any]) -> Any:
    """The session stored on `trainer`, opened with `open_session` on first use; `FAILED` once
    opening it failed (that first failure is raised)."""
    with _trainer_lock:
        session = getattr(trainer, TRAINER_ATTR, None)
        if session is None:
            try:
                session = open_session(trainer)
            except Exception:
                setattr(trainer, TRAINER_ATTR, FAILED)
                raise
        return session


def finish_after(owner: Any, method: str, session: SyncTraceSession, where: str) -> None:
    """Wrap `owner.<method>` (the trainer's `train`) so that `session` is finished once it returns
    or raises: a plain method at its return, a coroutine function when its coroutine ends.
    Finishing never raises; what it could not deliver is in the session's stats."""
    call = getattr(owner, method)

    def finish_quietly() -> None:
        try:
            session.finish()
        except Exception:  # the run ends either way
            logger.warning("asynctrace: %s: finishing the session failed", where, exc_info=True)

    @functools.wraps(call)
    def finishing(*args: Any, **kwargs: Any) -> Any:
        try:
            result = call(*args, **kwargs)
        except BaseException:
            finish_quietly()
            raise
        if not inspect.isawaitable(result):
            finish_quietly()
            return result

        async def awaited() -> Any:
            try:
                return await result
            finally:
                finish_quietly()

        return awaited()

    setattr(owner, method, finishing)
