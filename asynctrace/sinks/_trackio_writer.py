"""The Trackio side of `TrackioSink`: turns encoded records into Trackio traces.

It runs in a writer process by default (see `_trackio_worker`), or in a worker thread with
``TrackioSink(process=False)``. Kept free of asynctrace's event-loop code on purpose. How log ids
make retries and replays idempotent: docs/reliability.md ("Idempotency"); what the Traces tab
reads from them and from each trace's metadata: docs/sinks.md.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import re
import sqlite3
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from ..exceptions import PermanentSinkError
from ._trackio_spans import dashboard_spans
from ._trackio_versions import check_trackio_version

__all__ = [
    "HEADER",
    "TrackioWriter",
    "WriteItem",
    "dashboard_metadata",
    "decode_record_id",
    "log_id_for",
    "stored_record_ids",
]

# Frame header of the writer-process protocol: the length of the orjson header that follows.
HEADER = struct.Struct(">I")

# (record id, step, trace key, encoded sample, replayed, submitted at: seconds since the epoch)
WriteItem = tuple[str, int, str, bytes, bool, float]

# An entry's samples share one timestamp, its first's: one submitted this much later starts a
# new entry, so no trace shows a request time further than this from its own.
_SAME_TIME = 1.0

_COUNTED_ID = re.compile(r"^(.*)-(\d+)$")
# "{tag}-at-{first record id}"; "at-{first record id}" as written before the tag.
_LOG_ID = re.compile(r"^(?:[0-9a-f]{7}-)?at-(.+)$", re.DOTALL)
_TAG_SPACE = 16**7


def _split_id(record_id: str) -> tuple[str, int] | None:
    m = _COUNTED_ID.match(record_id)
    return (m.group(1), int(m.group(2))) if m else None


def _digest(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:7], 16)


def _tag(record_id: str) -> str:
    """Seven hex digits that lead the log id of the entry starting at `record_id`.

    For `{prefix}-{n}`, the prefix's digest plus n: entries of one session start at distinct n, so
    their tags differ (for fewer than 16**7 records), and sessions appending to one run start at
    unrelated offsets. Other ids get their own digest.
    """
    parts = _split_id(record_id)
    value = _digest(record_id) if parts is None else _digest(parts[0]) + parts[1]
    return f"{value % _TAG_SPACE:07x}"


def log_id_for(first_record_id: str) -> str:
    """The log id of the entry whose first trace is the record `first_record_id`."""
    return f"{_tag(first_record_id)}-at-{first_record_id}"


def decode_record_id(log_id: str | None, index: int | None) -> str | None:
    """The record id of the trace at `index` of the log entry `log_id`; None when not ours."""
    m = _LOG_ID.match(log_id) if log_id else None
    if m is None:
        return None
    first = m.group(1)
    if not index:
        return first
    parts = _split_id(first)
    return None if parts is None else f"{parts[0]}-{parts[1] + index}"


_STEPS_PER_QUERY = 500


def stored_record_ids(project: str, run_id: str, steps: Iterable[int] | None = None) -> set[str]:
    """Record ids whose traces are in the project's database for `run_id` (optionally some steps)."""
    from trackio.sqlite_storage import SQLiteStorage

    path = SQLiteStorage.get_project_db_path(project)
    if not path.exists():
        return set()
    query = "SELECT log_id, trace_index FROM traces WHERE run_id = ?"
    queries: list[tuple[str, list[Any]]] = [(query, [run_id])]
    if steps is not None:
        wanted = sorted(set(steps))
        # SQLite before 3.32 allows 999 parameters a statement: a batch can span more steps.
        queries = [
            (f"{query} AND step IN ({','.join('?' * len(part))})", [run_id, *part])
            for part in (wanted[i : i + _STEPS_PER_QUERY] for i in range(0, len(wanted), _STEPS_PER_QUERY))
        ]
    rows: list[tuple[str, int]] = []
    with sqlite3.connect(path, timeout=30.0) as conn:
        try:
            for sql, params in queries:
                rows += conn.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return set()
            raise
    out = set()
    for log_id, index in rows:
        record_id = decode_record_id(log_id, index)
        if record_id is not None:
            out.add(record_id)
    return out


def _entries(items: Sequence[WriteItem]) -> list[tuple[int, str, str, list[WriteItem]]]:
    """(step, key, log id, items) entries, each a run of consecutive record ids submitted within
    `_SAME_TIME` of its first (see above)."""
    out: list[tuple[int, str, str, list[WriteItem]]] = []
    open_runs: dict[tuple[int, str], tuple[list[WriteItem], str, int]] = {}
    for item in items:
        record_id, step, key = item[0], item[1], item[2]
        parts = _split_id(record_id)
        run = open_runs.get((step, key))
        if (
            run is not None
            and parts is not None
            and parts[0] == run[1]
            and parts[1] == run[2] + 1
            and abs(item[5] - run[0][0][5]) <= _SAME_TIME
        ):
            run[0].append(item)
            open_runs[(step, key)] = (run[0], run[1], parts[1])
            continue
        group = [item]
        out.append((step, key, log_id_for(record_id), group))
        if parts is not None:
            open_runs[(step, key)] = (group, parts[0], parts[1])
        else:
            open_runs.pop((step, key), None)
    return out


TRACE_TYPE = "trackio.trace"

# Stop reasons as frameworks and inference engines name them (vLLM, SGLang, OpenAI, Anthropic),
# and the status the Traces tab shows for each; any other reason is shown as it is.
_STATUS_OF_STOP_REASON = {
    "stop": "success",
    "eos": "success",
    "end_turn": "success",
    "stop_sequence": "success",
    "length": "truncated",
    "max_tokens": "truncated",
    "truncated": "truncated",
    "abort": "aborted",
    "aborted": "aborted",
    "cancelled": "aborted",
    "error": "error",
    "failed": "error",
}
_STOP_REASON_KEYS = ("stop_reason", "finish_reason")
# A generation time in seconds, or in milliseconds, as samples may carry it.
_SECONDS_KEYS = ("generation_time", "generation_time_s")
_MILLISECONDS_KEYS = ("generation_ms",)
_MAX_STATUS_CHARS = 40


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def dashboard_metadata(record_id: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """`metadata` with what Trackio's Traces tab reads added: the record id, a status from the
    stop reason, a duration from the generation time. A key the sample sets itself is kept."""
    out = dict(metadata)
    out.setdefault("asynctrace_id", record_id)
    if "status" not in out:
        for key in _STOP_REASON_KEYS:
            reason = out.get(key)
            if isinstance(reason, str) and reason:
                status = _STATUS_OF_STOP_REASON.get(reason.lower(), reason)
                out["status"] = status[:_MAX_STATUS_CHARS]
                break
    if "duration_ms" not in out and "latency_ms" not in out:
        for keys, scale in ((_SECONDS_KEYS, 1000.0), (_MILLISECONDS_KEYS, 1.0)):
            found = next((n for n in (_number(out.get(k)) for k in keys) if n is not None), None)
            if found is not None:
                out["duration_ms"] = round(found * scale, 3)
                break
    return out


def _iso(seconds: float) -> str:
    """A time as Trackio stores it: ISO 8601 in UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def _trace(record_id: str, payload: bytes) -> dict[str, Any]:
    sample = orjson.loads(payload)
    metadata = sample.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    return {
        "_type": TRACE_TYPE,
        "messages": sample["messages"],
        "metadata": dashboard_metadata(record_id, metadata),
        "spans": dashboard_spans(sample, metadata),
    }


class TrackioWriter:
    """Owns one Trackio run. In local mode each batch is committed to SQLite before `write` returns."""

    def __init__(
        self,
        project: str,
        run: str,
        *,
        space_id: str | None = None,
        server_url: str | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.project = project
        self.run_name = run
        self.run_id = run_id
        self.space_id = space_id
        self.server_url = server_url
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None
        self.finished = False

    @property
    def local(self) -> bool:
        """Whether the run writes to local SQLite, as Trackio itself decided.

        Trackio also reads ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` from the environment,
        so the constructor's arguments alone cannot tell: the opened run knows.
        """
        is_local = getattr(self.run, "_is_local", None)
        if isinstance(is_local, bool):
            return is_local
        from trackio import utils

        space_id, server_url = utils.resolve_space_id_and_server_url(self.space_id, self.server_url)
        return space_id is None and server_url is None

    def open(self) -> None:
        import trackio

        try:
            # The version this process imported, which a changed environment could make differ
            # from what the sink saw when it was made.
            check_trackio_version(getattr(trackio, "__version__", None))
        except ImportError as exc:
            raise PermanentSinkError(str(exc)) from None

        kwargs: dict[str, Any] = {
            "embed": False,
            "auto_log_cpu": False,
            "auto_log_gpu": False,
            "resume": "allow",
        }
        kwargs.update(self.init_kwargs)
        self.run = trackio.init(
            self.project,
            name=self.run_name,
            space_id=self.space_id,
            server_url=self.server_url,
            **kwargs,
        )
        if self.run_id is not None:
            # Joining a run another process opened (TRL's own, say): Trackio resumes a run by
            # name only once it has logged something, so two processes opening one name at the
            # same moment would make two runs. By id, this one writes where the other does;
            # the run's config stays its owner's.
            self.run.id = self.run_id
            self.run._config_logged = True

    def _commit(
        self,
        metrics_list: list[dict[str, Any]],
        steps: list[int],
        log_ids: list[str],
        timestamps: list[str] | None = None,
    ) -> None:
        """Commit log entries to the local store, with the run's config while it is not stored yet."""
        from trackio import utils
        from trackio.sqlite_storage import SQLiteStorage

        run = self.run
        config = None
        if not getattr(run, "_config_logged", True) and run.config:
            config = utils.to_json_safe(run.config)  # type: ignore[no-untyped-call]
        SQLiteStorage.bulk_log(
            project=self.project,
            run=run.name,
            run_id=run.id,
            metrics_list=metrics_list,
            steps=steps,
            log_ids=log_ids,
            timestamps=timestamps,
            config=config,
        )
        # Only once the write carrying it committed: a failed write is retried with the config.
        if config is not None:
            run._config_logged = True

    def write(self, items: Sequence[WriteItem]) -> int:
        """Log the records as traces; returns how many replayed ones were already stored (skipped).

        Locally, one log entry per run of consecutive record ids of a step and key (usually
        one per step), committed before this returns. Remotely, one ``run.log`` per step;
        there replays cannot be checked, so a replayed batch may repeat.
        """
        skipped = 0
        if self.local and any(item[4] for item in items):
            stored = stored_record_ids(self.project, self.run.id, {item[1] for item in items if item[4]})
            if stored:
                kept = [item for item in items if not (item[4] and item[0] in stored)]
                skipped = len(items) - len(kept)
                items = kept
        if not items:
            return skipped
        if self.local:
            entries = _entries(items)
            self._commit(
                [{key: [_trace(i[0], i[3]) for i in group]} for _, key, _, group in entries],
                [step for step, _, _, _ in entries],
                [log_id for _, _, log_id, _ in entries],
                # Trackio's "Request time": when the entry's first sample was submitted, also
                # for one replayed after a kill (not when it was written).
                [_iso(group[0][5]) for _, _, _, group in entries],
            )
            return skipped
        from trackio import Trace

        by_step: dict[int, dict[str, list[Any]]] = {}
        for record_id, step, key, payload, _, _ in items:
            t = _trace(record_id, payload)
            by_step.setdefault(step, {}).setdefault(key, []).append(
                Trace(t["messages"], t["metadata"], t["spans"])
            )
        for step, metrics in by_step.items():
            self.run.log(metrics, step=step)
        return skipped

    def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.local:
            # The log id is derived from the content, so a retry after a commit that did land (a
            # timeout after it, a restarted writer) maps onto the same row instead of adding one.
            content = orjson.dumps([self.run.id, step, dict(metrics)], option=orjson.OPT_SORT_KEYS)
            self._commit([dict(metrics)], [step], ["atm-" + hashlib.sha1(content).hexdigest()[:32]])
            return
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        if self.run is not None and not self.finished:
            self.run.finish()
            # trackio.init made this the current run; clear it so Trackio's own exit hook does
            # not finish it a second time.
            from trackio import context_vars

            if context_vars.current_run.get() is self.run:
                context_vars.current_run.set(None)
        self.finished = True
