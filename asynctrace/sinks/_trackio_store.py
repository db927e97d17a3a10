"""Trackio's local storage as `TrackioSink` uses it: which records a run holds, read back from the
project's database, and Trackio's private bulk commit, used only where it is found as expected.

Both ways the sink writes locally (docs/sinks/trackio.md, "How the sink writes to Trackio") rely on the
read-back: it skips what a replay finds already stored, and on the public path it is how a write
learns that Trackio's own thread has committed it. Imported in the writer only (it imports Trackio).
"""

from __future__ import annotations

import contextlib
import inspect
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import orjson

from ..exceptions import PermanentSinkError
from ._trackio_logids import decode_record_id

__all__ = ["BulkLog", "Found", "TraceStore", "damaged", "find_bulk_log", "writes_fragments"]

# SQLite before 3.32 allows 999 parameters a statement: a batch can span more steps.
_STEPS_PER_QUERY = 500
# The error names (and, before Python 3.11, messages) of a database file no retry can mend.
_DAMAGED_NAMES = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
_DAMAGED_TEXT = ("database disk image is malformed", "file is not a database")


def damaged(exc: BaseException) -> bool:
    """Whether `exc` says the database file itself is damaged (or not a database at all)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    name = getattr(exc, "sqlite_errorname", None)
    if isinstance(name, str):
        return name.startswith(_DAMAGED_NAMES)
    return any(text in str(exc) for text in _DAMAGED_TEXT)


class TraceStore:
    """The project's SQLite database, read for the record ids of a run's traces."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def of(cls, project: str) -> TraceStore:
        """The store of `project`, where this Trackio keeps it; PermanentSinkError where it cannot
        say (nothing the sink writes locally could then be confirmed)."""
        from trackio import sqlite_storage

        locate = getattr(getattr(sqlite_storage, "SQLiteStorage", None), "get_project_db_path", None)
        if not callable(locate):
            raise PermanentSinkError(
                "this Trackio has no SQLiteStorage.get_project_db_path: TrackioSink cannot find the "
                "project's database to confirm what it writes there"
            )
        return cls(Path(locate(project)))

    def record_ids(
        self, run_id: str, steps: Iterable[int] | None = None, *, by_log_id: bool = False
    ) -> set[str]:
        """Record ids whose traces the database holds for `run_id` (optionally at some steps).

        A trace is named by its log id where the sink chose it (the private commit) and by its
        `asynctrace_id` metadata otherwise (the public path, where Trackio picks log ids); with
        `by_log_id`, only by its log id."""
        if not self.path.exists():
            return set()
        query = "SELECT log_id, trace_index, metadata FROM traces WHERE run_id = ?"
        queries: list[tuple[str, list[Any]]] = [(query, [run_id])]
        if steps is not None:
            wanted = sorted(set(steps))
            parts = [wanted[i : i + _STEPS_PER_QUERY] for i in range(0, len(wanted), _STEPS_PER_QUERY)]
            queries = [(f"{query} AND step IN ({','.join('?' * len(p))})", [run_id, *p]) for p in parts]
        rows: list[tuple[object, object, object]] = []
        try:
            with contextlib.closing(sqlite3.connect(self.path, timeout=30.0)) as conn:
                for sql, params in queries:
                    rows += conn.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return set()  # nothing logged to the project yet
            if "no such column" in str(exc):
                raise PermanentSinkError(
                    f"Trackio's traces table is not laid out as TrackioSink reads it ({exc}): "
                    "it cannot confirm what it writes"
                ) from exc
            raise
        except sqlite3.DatabaseError as exc:
            if damaged(exc):
                raise PermanentSinkError(f"Trackio's database {self.path.name} is damaged: {exc}") from exc
            raise
        out: set[str] = set()
        for log_id, index, metadata in rows:
            record_id = decode_record_id(log_id, index)
            if record_id is None and not by_log_id:
                record_id = _metadata_id(metadata)
            if record_id is not None:
                out.add(record_id)
        return out


def _metadata_id(metadata: object) -> str | None:
    if not isinstance(metadata, (str, bytes)):
        return None  # SQLite stores any type in any column: not a trace of ours
    try:
        found = orjson.loads(metadata)
    except orjson.JSONDecodeError:
        return None  # not a trace of ours (nor of Trackio's own making)
    value = found.get("asynctrace_id") if isinstance(found, dict) else None
    return value if isinstance(value, str) else None


class BulkLog(Protocol):
    """`SQLiteStorage.bulk_log` as the private path calls it."""

    def __call__(
        self,
        *,
        project: str,
        run: str,
        run_id: str,
        metrics_list: list[dict[str, Any]],
        steps: list[int],
        log_ids: list[str],
        timestamps: list[str] | None,
        config: dict[str, Any] | None,
    ) -> None: ...


class Found(NamedTuple):
    """What `find_bulk_log` found: the commit to use, or why there is none."""

    bulk_log: BulkLog | None
    reason: str | None


_BULK_LOG_ARGS = ("project", "run", "run_id", "metrics_list", "steps", "log_ids", "timestamps", "config")
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def find_bulk_log() -> Found:
    """Trackio's private `SQLiteStorage.bulk_log`, where it takes every argument the sink passes
    by keyword and needs no other; otherwise why not (the sink then uses the public API).

    Whether it also stores what it is given is checked on the first write (`TrackioWriter`)."""
    try:
        from trackio import sqlite_storage, utils
    except ImportError as exc:
        return Found(None, f"Trackio's storage module cannot be imported ({exc})")
    bulk_log = getattr(getattr(sqlite_storage, "SQLiteStorage", None), "bulk_log", None)
    if not callable(bulk_log):
        return Found(None, "this Trackio has no SQLiteStorage.bulk_log")
    if not callable(getattr(utils, "to_json_safe", None)):
        return Found(None, "this Trackio has no utils.to_json_safe (for the run's config)")
    try:
        params = inspect.signature(bulk_log).parameters
    except (TypeError, ValueError):
        return Found(None, "SQLiteStorage.bulk_log's signature cannot be read")
    missing = [a for a in _BULK_LOG_ARGS if a not in params or params[a].kind not in _KEYWORD_KINDS]
    if missing:
        return Found(None, f"SQLiteStorage.bulk_log takes no keyword {', '.join(missing)}")
    required = [
        name
        for name, p in params.items()
        if name not in _BULK_LOG_ARGS
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        return Found(None, f"SQLiteStorage.bulk_log requires {', '.join(required)} as well")
    bound: BulkLog = bulk_log
    return Found(bound, None)


def writes_fragments() -> bool:
    """Whether this Trackio's `run.log` stores into JSONL fragments rather than the database
    (`TRACKIO_STORAGE_MODE=jsonl`, or a `TRACKIO_DIR` on a network filesystem): rows the
    read-back cannot see. False where this Trackio has no such mode."""
    from trackio import utils

    mode = getattr(utils, "get_storage_mode", None)
    return callable(mode) and mode() == "jsonl"
