"""The spool's on-disk format: segment files of orjson lines, each sealed with a CRC32.

A segment (``seg-*.jsonl``) starts with a header line naming its project and run, then holds
record lines (a record's fields and its encoded sample, as submitted; ``"w":1`` when it was
watched), acknowledgement lines (ids of records every sink has dealt with), sink lines (ids of
records one sink has dealt with, before the others) and tier lines (what each `Selected` sink
wrote of a step, and which steps it closed: see `TierState`). Format 1 files (no watched mark,
no sink or tier lines) read as before. A dead-letter file (``dead-*.jsonl``) holds records
whose sink failed for good, with the error. Every line ends ``,"c":<crc32>}`` where the CRC
covers the bytes before ``,"c":``, so a torn or corrupted line is detected rather than parsed
into wrong data.

Reading never raises on bad content: a torn last line, a corrupt line or an unreadable header
is counted and reported, and the rest of the spool is still used.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import orjson

from .._checks import MAX_STEP, check_project_run
from .._records.types import TraceRecord
from .._security import scrub_bytes

__all__ = [
    "DEAD",
    "SEGMENT",
    "DirScan",
    "FileScan",
    "RawRecord",
    "TierState",
    "ack_line",
    "dead_line",
    "header_line",
    "load_records",
    "new_file_name",
    "record_line_parts",
    "scan_dir",
    "sink_ack_line",
    "tier_line",
]

# 2: record lines may carry the watched mark; sink and tier lines. Version 1 files read as before.
FORMAT_VERSION = 2
SEGMENT: Final = "seg"
DEAD: Final = "dead"
SUFFIX = ".jsonl"
CORRUPT_SUFFIX = ".corrupt"
ACK_PREFIX = b'{"t":"a"'  # how every acknowledgement line starts
SINK_ACK_PREFIX = b'{"t":"s"'  # a sink's own acknowledgement (see `sink_ack_line`)
FileKind = Literal["seg", "dead"]

_CRC = b',"c":'
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A record's time in seconds: what a 64-bit count of microseconds holds (the sinks' columns).
_MAX_SECONDS = (2**63 - 1) / 1e6
_SAMPLE = b',"sample":'


def _seal(body: bytes) -> bytes:
    """`body` is a JSON object without its closing brace; append the CRC field and close it."""
    return b"%s%s%d}\n" % (body, _CRC, zlib.crc32(body))


def new_file_name(kind: FileKind, session: str, n: int) -> str:
    """Names sort by creation time, so files are read back in the order they were written."""
    return f"{kind}-{time.time_ns():020d}-{session}-{n:04d}{SUFFIX}"


def header_line(project: str, run: str, session: str, kind: FileKind) -> bytes:
    head = orjson.dumps(
        {
            "t": "h",
            "v": FORMAT_VERSION,
            "kind": kind,
            "project": project,
            "run": run,
            "session": session,
            "pid": os.getpid(),
            "created": time.time(),
        }
    )
    return _seal(head[:-1])


def _record_head(record: TraceRecord, kind: str, extra: dict[str, Any] | None = None) -> bytes:
    fields: dict[str, Any] = {
        "t": kind,
        "id": record.id,
        "step": record.step,
        "split": record.split,
        "key": record.key,
        "ts": record.timestamp,
        "score": record.score,
    }
    if record.watched:
        # On the watch list: a replay passes it by every selection again.
        fields["w"] = 1
    if extra:
        fields.update(extra)
    return orjson.dumps(fields)[:-1]


def record_line_parts(record: TraceRecord, secrets: list[bytes], out: list[bytes]) -> None:
    """Append one record line to `out` in pieces (joined once per commit, not copied per record):
    the record's fields, then its encoded sample as is (scrubbed of credentials)."""
    head = _record_head(record, "r") + _SAMPLE
    payload = scrub_bytes(record.payload, secrets)
    out += (head, payload, b"%s%d}\n" % (_CRC, zlib.crc32(payload, zlib.crc32(head))))


def dead_line(record: TraceRecord, error: str, sinks: Sequence[str], secrets: list[bytes]) -> bytes:
    """A dead letter: a record whose sinks failed for good, with the (already scrubbed) error."""
    head = _record_head(record, "d", {"error": error, "sinks": list(sinks)})
    return _seal(head + _SAMPLE + scrub_bytes(record.payload, secrets))


def ack_line(ids: Iterable[str], dead_file: str | None = None) -> bytes:
    """Acknowledges records by id; `dead_file` names the dead-letter file they came from, if any."""
    body: dict[str, Any] = {"t": "a", "ids": list(ids)}
    if dead_file is not None:
        body["dl"] = dead_file
    return _seal(orjson.dumps(body)[:-1])


def sink_ack_line(ids: Iterable[str], sink: str) -> bytes:
    """Records one sink (by its session name) has dealt with while others have not yet: a replay
    sends them to the others only."""
    return _seal(orjson.dumps({"t": "s", "ids": list(ids), "s": sink})[:-1])


def tier_line(sink: str, written: Iterable[tuple[str, int, int]], closed: Iterable[tuple[str, int]]) -> bytes:
    """A `Selected` sink's progress: (split, step, records written so far) and (split, last step
    closed), each a running total, so the last line of a key is what holds."""
    body = {"t": "k", "s": sink, "w": [list(w) for w in written], "x": [list(c) for c in closed]}
    return _seal(orjson.dumps(body)[:-1])


@dataclass(slots=True)
class TierState:
    """What `Selected` sinks had done before a kill, by sink name: records written per (split,
    step), and each split's last closed step (later records of a closed step are late)."""

    written: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)
    closed: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(
        self, sink: str, written: Iterable[tuple[str, int, int]], closed: Iterable[tuple[str, int]]
    ) -> None:
        """Running totals: the larger of two values of a key is the later one."""
        mine = self.written.setdefault(sink, {})
        for split, step, n in written:
            key = (split, step)
            mine[key] = max(mine.get(key, 0), n)
        upto = self.closed.setdefault(sink, {})
        for split, last in closed:
            upto[split] = max(upto.get(split, last), last)

    def merge(self, other: TierState) -> None:
        for sink, steps in other.written.items():
            self.add(sink, ((sp, st, n) for (sp, st), n in steps.items()), ())
        for sink, upto in other.closed.items():
            self.add(sink, (), upto.items())

    def __bool__(self) -> bool:
        return bool(self.written or self.closed)


# -- reading -----------------------------------------------------------------------------------


@dataclass(slots=True)
class RawRecord:
    """A record line as read back; the payload is loaded separately (see `load_records`)."""

    id: str
    step: int
    split: str
    key: str
    ts: float
    score: float | None
    offset: int  # of the payload within the file
    size: int
    error: str | None = None
    sinks: list[str] | None = None
    watched: bool = False
    # Set by `scan_dir`: the sinks that had dealt with it (sink lines), when only some had.
    done: frozenset[str] | None = None


@dataclass(slots=True)
class FileScan:
    """One spool file as read back."""

    name: str
    path: Path
    kind: FileKind
    size: int = 0
    project: str | None = None
    run: str | None = None
    session: str | None = None
    header_ok: bool = False
    records: list[RawRecord] = field(default_factory=list)
    acks: list[tuple[list[str], str | None]] = field(default_factory=list)
    sink_acks: list[tuple[list[str], str]] = field(default_factory=list)
    tiers: TierState = field(default_factory=TierState)
    torn: int = 0  # an unterminated last line: the process was killed mid-write
    corrupt: int = 0  # lines whose CRC or JSON is wrong
    corrupt_acks: int = 0  # of those, lines still recognisable as acknowledgements
    error: str | None = None  # the file could not be read at all
    # Filled in by `scan_dir`:
    unresolved: list[RawRecord] = field(default_factory=list)
    deps: set[str] = field(default_factory=set)

    @property
    def usable(self) -> bool:
        return self.header_ok and self.error is None

    @property
    def empty(self) -> bool:
        """Created, then killed before its header was written: nothing was lost."""
        return self.size == 0 and self.error is None

    @property
    def damaged(self) -> bool:
        """Data was lost: a corrupt line, or records or acknowledgements in a file that cannot be
        read or attributed. A torn last line alone is not: it is the write a kill cut short (of
        a call that had not returned, or of a batch no sink had seen), already lost to the kill."""
        if self.empty:
            return False
        unattributable = not self.header_ok and bool(self.records or self.acks)
        # A corrupt acknowledgement loses nothing: the records it acknowledged are replayed (at
        # least once). A corrupt line of any other kind may have been a record.
        lost = self.corrupt - self.corrupt_acks
        return bool(lost) or self.error is not None or unattributable

    def problems(self) -> str | None:
        """A one-line description of what was wrong with this file, or None."""
        if self.empty:
            return None
        parts = []
        if self.error is not None:
            parts.append(f"unreadable ({self.error})")
        elif not self.header_ok:
            parts.append("no valid header: the whole file is skipped")
        if self.torn:
            parts.append("a torn last line (killed mid-write) skipped")
        if self.corrupt:
            parts.append(f"{self.corrupt} corrupt line(s) skipped")
        return "; ".join(parts) or None


def _unseal(line: bytes) -> bytes | None:
    """The line's body (without the CRC field) when its CRC matches, else None."""
    cut = line.rfind(_CRC)
    if cut < 0 or not line.endswith(b"}"):
        return None
    body = line[:cut]
    try:
        crc = int(line[cut + len(_CRC) : -1])
    except ValueError:
        return None
    return body if zlib.crc32(body) == crc else None


def _number(value: Any, bound: float) -> bool:
    """`value` is a JSON number (not a bool) within `bound` either side of zero."""
    return type(value) in (int, float) and -bound <= value <= bound


def _parse_record(body: bytes, offset: int) -> RawRecord | None:
    """The record of a sealed line; None where its fields are not of the types and ranges a
    session writes (a spool is data: a line edited, its CRC made to match, is corrupt, never
    replayed into sinks as a step or time that they cannot store)."""
    cut = body.find(_SAMPLE)
    if cut < 0:
        return None
    head = orjson.loads(body[:cut] + b"}")
    start = cut + len(_SAMPLE)
    rid, step, split, key, ts, score = (head.get(k) for k in ("id", "step", "split", "key", "ts", "score"))
    error, sinks = head.get("error"), head.get("sinks")
    if not (
        type(rid) is str
        and type(step) is int
        and 0 <= step <= MAX_STEP
        and type(split) is str
        and type(key) is str
        and _number(ts, _MAX_SECONDS)
        and (score is None or _number(score, math.inf))
        and (error is None or type(error) is str)
        and (sinks is None or (type(sinks) is list and all(type(s) is str for s in sinks)))
        and body[start : start + 1] == b"{"  # an encoded sample is a JSON object
    ):
        return None
    return RawRecord(
        id=rid,
        step=step,
        split=split,
        key=key,
        ts=float(ts),
        score=None if score is None else float(score),
        offset=offset + start,
        size=len(body) - start,
        error=error,
        sinks=sinks,
        watched=bool(head.get("w")),
    )


def _read_regular(path: Path) -> bytes:
    """The bytes of the regular file at `path`; an OSError for anything else. A spool directory
    gets copied between people: a link in it is never followed (it could lead to another spool's
    files, or anywhere), nor a FIFO waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a link, not followed") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return f.read()


def read_file(path: Path, kind: FileKind) -> FileScan:
    scan = FileScan(name=path.name, path=path, kind=kind)
    try:
        data = _read_regular(path)
    except OSError as exc:
        scan.error = f"{type(exc).__name__}: {exc.strerror or exc}"
        return scan
    scan.size = len(data)
    pos = 0
    first = True
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            scan.torn += 1
            break
        line = data[pos:end]
        body = _unseal(line)
        parsed = False
        if body is not None:
            try:
                parsed = _take_line(scan, body, pos, first)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                parsed = False
        if not parsed:
            scan.corrupt += 1
            if line.startswith(ACK_PREFIX) or line.startswith(SINK_ACK_PREFIX):
                scan.corrupt_acks += 1
        first = False
        pos = end + 1
    return scan


def _take_line(scan: FileScan, body: bytes, offset: int, first: bool) -> bool:
    # The line type is the first field; checking the prefix avoids decoding large samples.
    if body.startswith(b'{"t":"r"') or body.startswith(b'{"t":"d"'):
        record = _parse_record(body, offset)
        if record is None:
            return False
        scan.records.append(record)
        return True
    obj = orjson.loads(body + b"}")
    kind = obj.get("t")
    if kind == "h" and first:
        # The names a session can have (recover opens a session with them): a header naming
        # another (a path, a dict) leaves the whole file skipped, not the recovery stopped.
        project, run, session = obj["project"], obj["run"], obj.get("session")
        if run is None or (session is not None and type(session) is not str):
            return False
        check_project_run(project, run)  # a ValueError: the line is corrupt
        scan.project, scan.run, scan.session = project, run, str(session)
        scan.header_ok = True
        return True
    if kind == "a":
        ids = obj["ids"]
        if not isinstance(ids, list):
            return False
        dead = obj.get("dl")
        scan.acks.append(([str(i) for i in ids], None if dead is None else str(dead)))
        return True
    if kind == "s":
        ids = obj["ids"]
        if not isinstance(ids, list):
            return False
        scan.sink_acks.append(([str(i) for i in ids], str(obj["s"])))
        return True
    if kind == "k":
        written = [(str(sp), int(st), int(n)) for sp, st, n in obj["w"]]
        closed = [(str(sp), int(last)) for sp, last in obj["x"]]
        scan.tiers.add(str(obj["s"]), written, closed)
        return True
    return False


@dataclass(slots=True)
class DirScan:
    """Every spool file of a directory, with what is still unresolved and the acknowledgement graph."""

    files: list[FileScan]

    @property
    def problems(self) -> list[tuple[str, str]]:
        return [(f.name, p) for f in self.files if (p := f.problems()) is not None]

    def pending(self, kind: FileKind = SEGMENT) -> int:
        return sum(len(f.unresolved) for f in self.files if f.kind == kind and f.usable)

    def tiers(self, source: tuple[str, str], sessions: frozenset[str] | None = None) -> TierState:
        """What the `Selected` sinks of `source`'s sessions (or of these `sessions`) had done."""
        out = TierState()
        for f in self.files:
            if f.usable and (f.project, f.run) == source and (sessions is None or f.session in sessions):
                out.merge(f.tiers)
        return out

    def groups(self, kind: FileKind = SEGMENT) -> dict[tuple[str, str], int]:
        """Unresolved records per (project, run)."""
        out: dict[tuple[str, str], int] = {}
        for f in self.files:
            if f.kind == kind and f.usable and f.unresolved:
                assert f.project is not None and f.run is not None
                key = (f.project, f.run)
                out[key] = out.get(key, 0) + len(f.unresolved)
        return out


def scan_dir(directory: Path) -> DirScan:
    """Read every spool file of `directory` and work out which records are still unresolved.

    A record is resolved by an acknowledgement anywhere in the spool: acknowledgements are
    written to whichever segment was active when the record was done, which is never an
    earlier one. `deps` records which files a file's acknowledgements refer to, so a file is
    deleted only after those (see `books.Books.collect`).
    """
    # Links too, to be told (`read_file` does not follow them).
    paths = sorted(p for p in directory.iterdir() if p.suffix == SUFFIX and (p.is_file() or p.is_symlink()))
    files: list[FileScan] = []
    for path in paths:
        if path.name.startswith(f"{SEGMENT}-"):
            files.append(read_file(path, SEGMENT))
        elif path.name.startswith(f"{DEAD}-"):
            files.append(read_file(path, DEAD))
    holder: dict[str, str] = {}
    for f in files:
        if f.kind == SEGMENT:
            for r in f.records:
                holder[r.id] = f.name
    acked: set[str] = set()
    dead_acked: dict[str, set[str]] = {}
    for f in files:
        for ids, dead in f.acks:
            if dead is None:
                acked.update(ids)
                for i in ids:
                    target = holder.get(i)
                    if target is not None and target != f.name:
                        f.deps.add(target)
            else:
                dead_acked.setdefault(dead, set()).update(ids)
                if dead != f.name:
                    f.deps.add(dead)
    by_sink: dict[str, set[str]] = {}
    for f in files:
        for ids, sink in f.sink_acks:
            for i in ids:
                by_sink.setdefault(i, set()).add(sink)
                target = holder.get(i)
                if target is not None and target != f.name:
                    f.deps.add(target)
    for f in files:
        done = acked if f.kind == SEGMENT else dead_acked.get(f.name, set())
        f.unresolved = [r for r in f.records if r.id not in done]
        if by_sink and f.kind == SEGMENT:
            for r in f.unresolved:
                sinks = by_sink.get(r.id)
                r.done = frozenset(sinks) if sinks else None
    return DirScan(files)


def load_records(scan: FileScan, records: Sequence[RawRecord]) -> list[TraceRecord]:
    """The payloads of `records` read back from `scan`'s file, as replayed `TraceRecord`s."""
    if not records:
        return []
    data = _read_regular(scan.path)
    out = []
    for r in records:
        payload = data[r.offset : r.offset + r.size]
        record = TraceRecord(r.id, r.step, r.split, r.key, payload, r.ts, r.score, replayed=True)
        record.watched = r.watched
        record.sinks_done = r.done
        out.append(record)
    return out
