"""Sessions a hook opens itself when given a project name instead of a session, so that a hook
line in a framework's loop needs no setup: the first call opens one, later calls reuse it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Literal

from .._security import logger
from .._sync import SyncTraceSession

if TYPE_CHECKING:
    from .._session import TraceSession

__all__ = ["session_for"]


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
