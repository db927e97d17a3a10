"""Exceptions raised by asynctrace. One class per condition."""

from __future__ import annotations

from ._security import scrub

__all__ = [
    "AsyncTraceError",
    "PermanentSinkError",
    "RecordError",
    "SessionClosedError",
    "SpoolError",
]


class AsyncTraceError(Exception):
    """Root of every error asynctrace raises."""


class RecordError(AsyncTraceError, ValueError):
    """A sample could not be validated or encoded; names the sample index and field path.

    The message and the path quote the caller's data (a metadata key, a value's repr): both are
    scrubbed of credentials here, whoever raises it.
    """

    def __init__(self, message: str, *, index: int | None = None, path: str | None = None) -> None:
        super().__init__(scrub(message))
        self.index = index
        self.path = scrub(path) if path else path


class SessionClosedError(AsyncTraceError):
    """The session was used after it was finished (or before it was started)."""


class PermanentSinkError(AsyncTraceError):
    """Raised by a sink for a failure that retrying cannot fix; the batch is counted as failed."""


class SpoolError(AsyncTraceError):
    """The spool directory cannot be used: it is locked by another session, or not a usable directory."""
