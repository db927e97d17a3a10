"""The Trackio side of `TrackioSink`: turns encoded records into Trackio traces and stores them.

It runs in a writer process by default (see `_trackio_worker`), or in a worker thread with
``TrackioSink(process=False)``. Kept free of asynctrace's event-loop code on purpose. It writes in
one of three ways, its `path` (docs/sinks/trackio.md, "How the sink writes to Trackio"):

- ``"private"``, locally where Trackio's storage class is as expected (`find_bulk_log`): each batch
  committed through `SQLiteStorage.bulk_log` before `write` returns, under log ids of the sink's
  own, so that a retry lands on the same rows (docs/reliability.md, "Idempotency");
- ``"public"``, locally otherwise: through the run's public `log`, which Trackio commits on a
  thread of its own. `write` returns once reading the database back shows every trace, and logs
  again, on its next attempt, what Trackio did not store;
- ``"remote"``, to a Space or a server: through `run.log`, handed over and not confirmed.
"""

from __future__ import annotations

import hashlib
import sqlite3
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import orjson

from ..exceptions import PermanentSinkError
from ._trackio_logids import log_id_for, split_id
from ._trackio_run import TrackioRun
from ._trackio_store import BulkLog, TraceStore, damaged, find_bulk_log, writes_fragments
from ._trackio_traces import iso_time, trace_of
from ._trackio_versions import check_trackio_version

__all__ = ["HEADER", "TrackioWriter", "WriteItem", "stored_record_ids"]

# Frame header of the writer-process protocol: the length of the orjson header that follows.
HEADER = struct.Struct(">I")


class WriteItem(NamedTuple):
    """One record as the writer gets it."""

    record_id: str
    step: int
    key: str  # the trace key, "{split}/traces" by default
    payload: bytes  # the encoded sample
    replayed: bool
    timestamp: float  # when it was submitted: seconds since the epoch


class _Entry(NamedTuple):
    """One log entry of the private commit: a step's run of consecutive records under one key."""

    step: int
    key: str
    log_id: str
    items: list[WriteItem]


# An entry's samples share one timestamp, its first's: one submitted this much later starts a
# new entry, so no trace shows a request time further than this from its own.
_SAME_TIME = 1.0
# The public path: how long a write waits for Trackio's own thread (it commits every 0.5 s)
# before finishing the run to flush it, and how often it reads the database meanwhile.
_FLUSH_WAIT = 5.0
_POLL = 0.1


def stored_record_ids(project: str, run_id: str, steps: Iterable[int] | None = None) -> set[str]:
    """Record ids whose traces are in the project's database for `run_id` (optionally some steps)."""
    return TraceStore.of(project).record_ids(run_id, steps)


class _Open(NamedTuple):
    """The entry a step's next consecutive record may join: its prefix and last number."""

    entry: _Entry
    prefix: str
    last: int


def _entries(items: Sequence[WriteItem]) -> list[_Entry]:
    """The private commit's entries, each a run of consecutive record ids of one step and key
    submitted within `_SAME_TIME` of its first (see above)."""
    out: list[_Entry] = []
    open_runs: dict[tuple[int, str], _Open] = {}
    for item in items:
        parts = split_id(item.record_id)
        where = (item.step, item.key)
        run = open_runs.get(where)
        if (
            run is not None
            and parts is not None
            and parts == (run.prefix, run.last + 1)
            and abs(item.timestamp - run.entry.items[0].timestamp) <= _SAME_TIME
        ):
            run.entry.items.append(item)
            open_runs[where] = run._replace(last=parts[1])
            continue
        entry = _Entry(item.step, item.key, log_id_for(item.record_id), [item])
        out.append(entry)
        if parts is not None:
            open_runs[where] = _Open(entry, *parts)
        else:
            open_runs.pop(where, None)
    return out


_STILL_COMMITTING = (
    "Trackio is still committing what an earlier attempt logged (a locked database?): the next "
    "attempt reads back what it stored before logging anything again"
)


class TrackioWriter:
    """Owns one Trackio run and writes records to it the way its `path` says (see above)."""

    def __init__(
        self,
        project: str,
        run: str,
        *,
        space_id: str | None = None,
        server_url: str | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        seal_writes: bool = False,
    ) -> None:
        """`seal_writes`: on the public path, finish the run after each write (Trackio's only public
        flush: it commits at once instead of at its thread's next turn) and open it again for the
        next. Trackio prints on both, so this is for a process whose console is the writer's own
        (the writer process): its prints are silenced meanwhile."""
        self.project = project
        self.run_name = run
        self.run_id = run_id
        self.space_id = space_id
        self.server_url = server_url
        self.init_kwargs = dict(init_kwargs or {})
        self.seal_writes = seal_writes
        self.finished = False
        #: How this writer writes, once open: "private", "public" or "remote" (see above).
        self.path: str | None = None
        #: Why a local run is written through the public API; None on the private path.
        self.fallback: str | None = None
        self._run = TrackioRun(
            project,
            run,
            space_id=space_id,
            server_url=server_url,
            init_kwargs=self.init_kwargs,
            run_id=run_id,
            quiet=seal_writes,
        )
        self._trace_type: Any = None  # trackio.Trace
        self._store: TraceStore | None = None
        self._bulk_log: BulkLog | None = None
        self._checked = False  # the private commit's first write has been read back
        # Calls a timeout abandoned (in a worker thread) still run: one at a time.
        self._lock = threading.Lock()

    @property
    def run(self) -> Any:
        """The `trackio.Run` written to (None before `open`)."""
        return self._run.run

    @property
    def local(self) -> bool:
        """Whether the run writes to this machine's Trackio database (Trackio decides, see `open`)."""
        return self.path in ("private", "public")

    def open(self) -> None:
        import trackio

        try:
            # The version this process imported, which a changed environment could make differ
            # from what the sink saw when it was made.
            check_trackio_version(getattr(trackio, "__version__", None))
        except ImportError as exc:
            raise PermanentSinkError(str(exc)) from None
        self._trace_type = getattr(trackio, "Trace", None)
        if self._trace_type is None:
            raise PermanentSinkError("this Trackio has no trackio.Trace: TrackioSink cannot log traces")
        self._run.open()
        if not self._run.is_local():
            self.path = "remote"
            return
        self._store = TraceStore.of(self.project)
        found = find_bulk_log()
        if found.bulk_log is None:
            self._use_public(found.reason or "SQLiteStorage.bulk_log is not usable")
            return
        self._bulk_log = found.bulk_log
        self.path = "private"

    def _use_public(self, reason: str) -> None:
        if writes_fragments():
            raise PermanentSinkError(
                f"TrackioSink cannot use Trackio's public API here ({reason}): this Trackio stores what "
                "run.log gets as JSONL fragments (TRACKIO_STORAGE_MODE=jsonl, or TRACKIO_DIR on a "
                "network filesystem), which the sink cannot read back to confirm. Set "
                "TRACKIO_STORAGE_MODE=sqlite"
            )
        self._bulk_log = None
        self.path = "public"
        self.fallback = reason

    def write(self, items: Sequence[WriteItem]) -> int:
        """Log the records as traces; returns how many replayed ones were already stored (skipped).

        Locally, `write` returns once every trace is in the database (committed on the private
        path, read back on the public one). Remotely, one ``run.log`` per step; there replays
        cannot be checked, so a replayed batch may repeat.
        """
        with self._lock:
            if self.path == "private":
                return self._write_private(items)
            if self.path == "public":
                return self._write_public(items)
            self._log(items)
            return 0

    def _write_private(self, items: Sequence[WriteItem]) -> int:
        """One log entry per run of consecutive record ids of a step and key (usually one per
        step), committed before this returns; a replay first skips what the run holds."""
        skipped, todo = self._unstored(items, every=False)
        if not todo:
            return skipped
        entries = _entries(todo)
        self._commit(
            [{e.key: [trace_of(i.record_id, i.payload) for i in e.items]} for e in entries],
            [e.step for e in entries],
            [e.log_id for e in entries],
            # Trackio's "Request time": when the entry's first sample was submitted, also for
            # one replayed after a kill (not when it was written).
            [iso_time(e.items[0].timestamp) for e in entries],
        )
        if not self._checked:
            # Found as expected is not yet shown to work: the first write is read back, by the
            # log ids it was given (which keep a retry from adding rows).
            self._checked = True
            held = self._held({i.step for i in todo}, by_log_id=True)
            missing = {i.record_id for i in todo} - held
            if missing:
                self._use_public(
                    f"SQLiteStorage.bulk_log did not store {len(missing)} of the {len(todo)} traces it "
                    "was given under their log ids"
                )
                return skipped + self._write_public(todo)
        return skipped

    def _write_public(self, items: Sequence[WriteItem]) -> int:
        """Log what the run does not hold yet through `run.log`, and return once it is stored.

        Trackio logs on its own thread, never raises, and drops what it fails to commit (with a
        warning): the database read back is what tells. What is missing once the run is finished
        (so once Trackio is done with it) raises, and the retry logs it again.
        """
        if not self._run.settled(_FLUSH_WAIT):
            raise RuntimeError(_STILL_COMMITTING)
        skipped, todo = self._unstored(items, every=True)
        if not todo:
            return skipped
        self._run.reopen()
        try:
            self._log(todo)
            if self.seal_writes:
                self._run.seal()
            missing = self._await_stored(todo)
        except BaseException:
            # What was handed over may still be queued in Trackio: finished, it is either stored
            # or dropped (or its threads are awaited) before the next attempt logs anything.
            self._run.seal()
            raise
        if missing:
            raise RuntimeError(
                f"Trackio did not store {len(missing)} of the {len(todo)} traces given to run.log (its "
                "warning says why); the next attempt logs them again"
            )
        return skipped

    def _await_stored(self, items: Sequence[WriteItem]) -> set[str]:
        """The items' record ids the database lacks once Trackio is done with them: read back
        until all are there, finishing the run (which waits for Trackio's thread) after
        `_FLUSH_WAIT` seconds."""
        deadline = time.monotonic() + _FLUSH_WAIT
        while not self._run.sealed:
            missing = self._missing(items)
            if not missing:
                return missing
            if time.monotonic() >= deadline:
                self._run.seal()
            else:
                time.sleep(_POLL)
        if not self._run.settled(_FLUSH_WAIT):
            raise RuntimeError(_STILL_COMMITTING)
        return self._missing(items)

    def _unstored(self, items: Sequence[WriteItem], *, every: bool) -> tuple[int, list[WriteItem]]:
        """The items to write: all but those the run holds among the replayed ones (with `every`,
        among all of them); and how many replayed ones it held."""
        asked = items if every else [i for i in items if i.replayed]
        if not asked:
            return 0, list(items)
        held = self._held({i.step for i in asked})
        todo = [i for i in items if i.record_id not in held or not (every or i.replayed)]
        return sum(1 for i in items if i.replayed and i.record_id in held), todo

    def _held(self, steps: set[int], *, by_log_id: bool = False) -> set[str]:
        assert self._store is not None
        return self._store.record_ids(self.run.id, steps, by_log_id=by_log_id)

    def _missing(self, items: Sequence[WriteItem]) -> set[str]:
        return {i.record_id for i in items} - self._held({i.step for i in items})

    def _log(self, items: Sequence[WriteItem]) -> None:
        """Hand the records to the run's public `log`, one call per step."""
        by_step: dict[int, dict[str, list[Any]]] = {}
        for item in items:
            t = trace_of(item.record_id, item.payload)
            trace = self._trace_type(t["messages"], metadata=t["metadata"], spans=t["spans"])
            by_step.setdefault(item.step, {}).setdefault(item.key, []).append(trace)
        for step, metrics in by_step.items():
            self.run.log(metrics, step=step)

    def _commit(
        self,
        metrics_list: list[dict[str, Any]],
        steps: list[int],
        log_ids: list[str],
        timestamps: list[str] | None = None,
    ) -> None:
        """Commit log entries through the private path, with the run's config while it is not stored yet."""
        from trackio import utils

        assert self._bulk_log is not None
        run = self.run
        config = None
        if not getattr(run, "_config_logged", True) and run.config:
            config = utils.to_json_safe(run.config)  # type: ignore[no-untyped-call]
        try:
            self._bulk_log(
                project=self.project,
                run=run.name,
                run_id=run.id,
                metrics_list=metrics_list,
                steps=steps,
                log_ids=log_ids,
                timestamps=timestamps,
                config=config,
            )
        except sqlite3.DatabaseError as exc:
            if damaged(exc):
                damage = f"Trackio's database of project {self.project!r} is damaged: {exc}"
                raise PermanentSinkError(damage) from exc
            raise
        # Only once the write carrying it committed: a failed write is retried with the config.
        if config is not None:
            run._config_logged = True

    def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        with self._lock:
            if self.path == "private":
                # The log id is derived from the content, so a retry after a commit that did land
                # (a timeout after it, a restarted writer) maps onto the same row instead of adding one.
                content = orjson.dumps([self.run.id, step, dict(metrics)], option=orjson.OPT_SORT_KEYS)
                self._commit([dict(metrics)], [step], ["atm-" + hashlib.sha1(content).hexdigest()[:32]])
                return
            # Handed over: Trackio's thread commits them, at the latest with the next seal or finish.
            self._run.reopen()
            self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        with self._lock:
            if not self.finished:
                self._run.finish()
            self.finished = True
