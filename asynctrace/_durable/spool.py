"""The write-ahead spool: encoded records on disk until every sink has them (docs/reliability.md).

Records are *staged* in memory (cheap, safe under the buffer lock) and *committed* to the active
segment by whoever needs them on disk: the caller in ``durability="enqueue"``, the writer's
dispatcher in ``"writer"``. Resolutions (written, dropped, failed) are staged the same way and
committed lazily as acknowledgement lines (a failed record also gets a dead-letter line), through
the same ordered list, so a record's line is always written before its acknowledgement. While
several sinks are at work, what one of them has dealt with is committed as a sink line, so a
replay sends each record only to the sinks that lack it; each `Selected` sink's progress (what it
wrote of each step, the steps it closed) is committed as tier lines, running totals that every
new segment starts with again, so the newest one always holds all of them.

The files' table, the acknowledgement, sink and tier lines, and which files may go are kept by
`books.py`. A segment is deleted when none of its records is unresolved and every segment it
holds acknowledgements for is gone (deleting it earlier would bring those records back on replay);
a session's newest segment with tier lines also stays while any file of that session holds
unresolved records (their replay needs what the tiers had done).
A failed write (a full disk) truncates the partial line away, counts the records as
``unspooled`` and logs one error: the records are still delivered to the sinks.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from .._records.types import TraceRecord
from .._security import describe, logger, secret_bytes
from .._stats import SpoolStats
from ..exceptions import SpoolError
from . import segments as seg
from .books import Books, SpoolFile
from .directory import SpoolDir, WriteErrors
from .setup import remove_setup, write_setup

__all__ = ["STAGED", "UNSPOOLED", "Durability", "Spool"]

Durability = Literal["writer", "enqueue"]

# TraceRecord.spool_slot: None = not spooled, STAGED = waiting for a commit, UNSPOOLED = its write
# failed, an int >= 0 = the index of the file that holds it.
STAGED = -1
UNSPOOLED = -2

SEGMENT_BYTES = 16 * 2**20

_STAGE = 0
_ACK = 1
_DEAD = 2
_SINK = 3  # one sink dealt with records (error: the sink's name)
_TIER = 4  # a tier's progress (error: the sink's name; extra: (written deltas, closed prefix, set))

# One staged operation: (kind, records, error, failed sinks, pre-encoded lines or None, extra).
_Op = tuple[int, Sequence[TraceRecord], str | None, Sequence[str], list[bytes] | None, Any]


class Spool:
    """One session's view of a spool directory; see the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        project: str,
        run: str,
        session: str,
        durability: Durability,
        setup: Sequence[Mapping[str, Any]] | None = None,
        within: SpoolDir | None = None,
    ) -> None:
        self.directory = Path(directory).expanduser()
        # The session's sinks, for `asynctrace recover` (see setup.py).
        self._setup = setup
        self.project = project
        self.run = run
        self.session = session
        self.durability = durability
        self._books = Books()
        self._files = self._books.files  # the books' table: the spool adds, writes and closes files
        self._by_name: dict[str, SpoolFile] = {}
        self._next = 0
        self._active: SpoolFile | None = None
        self._dead: SpoolFile | None = None
        self._made = 0
        self._ops: list[_Op] = []
        self._plock = threading.Lock()  # guards _ops; taken under the buffer lock
        self._io = threading.Lock()  # one commit at a time, in order
        # `within`: the lock `asynctrace recover` holds for all its sessions (see SpoolDir).
        self._dir = SpoolDir(self.directory, within=within)
        self._errors = WriteErrors(self.directory)
        self.appended = self.acknowledged = self.dead_letters = 0
        self._secrets_at = -math.inf
        self._secret_bytes: list[bytes] = []
        self.closed = False

    # -- opening ---------------------------------------------------------------------------

    def open(self) -> seg.DirScan:
        """Create or check the directory (0700), lock it, read what a previous session left."""
        self._dir.lock()
        try:
            scan = seg.scan_dir(self.directory)
            for f in scan.files:
                self._register(f)
            self._books.collect()
            if self._setup is not None:
                write_setup(self.directory, self.session, self.project, self.run, self._setup)
        except OSError as exc:
            self._dir.unlock()
            raise SpoolError(f"cannot read the spool directory {self.directory}: {describe(exc)}") from exc
        except BaseException:
            self._dir.unlock()
            raise
        return scan

    def _register(self, scan: seg.FileScan) -> SpoolFile:
        f = SpoolFile(self._next, scan.name, scan.path, scan.kind, size=scan.size, session=scan.session)
        f.tiers = bool(scan.tiers)
        self._next += 1
        if scan.empty:
            self._unlink(f)
        elif not scan.usable:
            # Its records cannot be attributed to a project and run: set it aside, keep it.
            quarantine = scan.path.with_name(scan.name + seg.CORRUPT_SUFFIX)
            with contextlib.suppress(OSError):
                scan.path.rename(quarantine)
                f.path = quarantine
            f.keep = True
        else:
            f.live = len(scan.unresolved)
        self._files[f.index] = f
        self._by_name[f.name] = f
        for name in scan.deps:
            dep = self._by_name.get(name)
            if dep is not None:
                f.deps.add(dep.index)
        return f

    def backlog(
        self, scan: seg.DirScan, match: Callable[[seg.FileScan], bool]
    ) -> Iterator[list[TraceRecord]]:
        """The unresolved records of the files `match` selects, one file at a time, ready to replay."""
        for fs in scan.files:
            if not fs.usable or not fs.unresolved or not match(fs):
                continue
            f = self._by_name[fs.name]
            try:
                records = seg.load_records(fs, fs.unresolved)
            except OSError as exc:
                logger.error("asynctrace: cannot read spool file %s: %s", fs.path, describe(exc))
                continue
            for r in records:
                r.spool_slot = f.index
            yield records

    # -- staging (any thread; cheap; may run under the buffer lock) --------------------------

    def stage(self, records: Sequence[TraceRecord], *, encode: bool = False) -> None:
        """Queue records for the spool; ones already spooled or staged are skipped.

        With `encode`, their lines are built now rather than in the commit, so a caller can
        spread that work over several event-loop turns.
        """
        fresh = [r for r in records if r.spool_slot is None]
        if not fresh:
            return
        for r in fresh:
            r.spool_slot = STAGED
        lines: list[bytes] | None = None
        if encode:
            lines = []
            secrets = self._secrets()
            for r in fresh:
                seg.record_line_parts(r, secrets, lines)
        with self._plock:
            self._ops.append((_STAGE, fresh, None, (), lines, None))

    def resolve(
        self, records: Sequence[TraceRecord], error: str | None = None, sinks: Sequence[str] = ()
    ) -> None:
        """Records are done: written or dropped (`error` None), or failed for good (dead letters)."""
        with self._plock:
            self._ops.append((_ACK if error is None else _DEAD, records, error, sinks, None, None))

    def sink_done(self, records: Sequence[TraceRecord], sink: str) -> None:
        """One sink (its name in the session) dealt with records that others may not have yet."""
        with self._plock:
            self._ops.append((_SINK, records, sink, (), None, None))

    def tier(
        self,
        sink: str,
        written: Mapping[tuple[str, int], int],
        closed: Mapping[str, int],
        *,
        absolute: bool = False,
    ) -> None:
        """A `Selected` sink wrote `written` more records of these (split, step)s, and has closed
        each split's steps up to `closed`; with `absolute`, the counts are totals (a replay's)."""
        with self._plock:
            self._ops.append((_TIER, (), sink, (), None, (dict(written), dict(closed), absolute)))

    @property
    def has_staged(self) -> bool:
        return bool(self._ops)

    # -- committing ------------------------------------------------------------------------

    def commit(self, *, blocking: bool = True) -> bool:
        """Write everything staged so far, in order. False when `blocking` is False and another
        commit is under way (that one or a later one writes what is staged)."""
        if not self._io.acquire(blocking=blocking):
            return False
        try:
            with self._plock:
                ops, self._ops = self._ops, []
            if ops and not self.closed:
                self._write(ops)
            return True
        finally:
            self._io.release()

    def _secrets(self) -> list[bytes]:
        # Reading the environment costs more than a small commit; credentials rarely change.
        now = time.monotonic()
        if now - self._secrets_at > 1.0:
            self._secrets_at = now
            self._secret_bytes = secret_bytes()
        return self._secret_bytes

    def _write(self, ops: list[_Op]) -> None:
        secrets = self._secrets()
        active = self._ensure_file(seg.SEGMENT)
        target = active.index if active is not None else UNSPOOLED
        lines: list[bytes] = []
        fresh: list[TraceRecord] = []
        done: list[TraceRecord] = []
        dead: list[tuple[TraceRecord, str, Sequence[str]]] = []
        partial: dict[str, list[TraceRecord]] = {}
        tiers: dict[str, tuple[set[tuple[str, int]], set[str]]] = {}
        lost = 0
        for kind, records, error, sinks, encoded, extra in ops:
            if kind == _SINK:
                assert error is not None
                partial.setdefault(error, []).extend(records)
                continue
            if kind == _TIER:
                assert error is not None
                written, closed, absolute = extra
                self._books.tier_update(
                    error, written, closed, absolute, tiers.setdefault(error, (set(), set()))
                )
                continue
            if kind == _STAGE:
                # Staged records are still STAGED here: nothing else resolves a record before
                # the commit that writes it (its acknowledgement is always staged after it).
                for r in records:
                    r.spool_slot = target
                if active is None:
                    lost += len(records)
                    continue
                if encoded is not None:
                    lines += encoded
                else:
                    for r in records:
                        seg.record_line_parts(r, secrets, lines)
                fresh += records
            elif kind == _ACK:
                done.extend(records)
            else:
                assert error is not None
                dead.extend((r, error, sinks) for r in records)
        if active is None and lost:
            self._errors.failed(self._errors.last_error or "no segment could be created", lost)
        if dead:
            done.extend(self._write_dead(dead, secrets))
        acks, deps = self._books.ack_lines(done, active)
        if partial:
            acks += self._books.sink_lines(partial, done, active, deps)
        if tiers and active is not None:
            acks += self._books.tier_lines({k: v for k, v in tiers.items()})
        ok = True
        if active is not None and (lines or acks):
            error = self._append(active, b"".join(lines) + acks)
            if error is not None:
                ok = False
                for r in fresh:
                    r.spool_slot = UNSPOOLED
                self._errors.failed(error, len(fresh))
                fresh = []
            elif fresh:
                self._errors.succeeded()
        if active is not None:
            active.live += len(fresh)
            self.appended += len(fresh)
            if ok:
                active.deps.update(deps)
                if tiers:
                    active.tiers = True
        for r in done:
            where = r.spool_slot
            if where is not None and where >= 0:
                f = self._files.get(where)
                if f is not None:
                    f.live -= 1
                    self.acknowledged += 1
        self._books.collect()

    def _write_dead(
        self, dead: list[tuple[TraceRecord, str, Sequence[str]]], secrets: list[bytes]
    ) -> list[TraceRecord]:
        """Append dead letters; returns the records now safely there (to acknowledge)."""
        f = self._ensure_file(seg.DEAD)
        if f is None:
            return []
        data = b"".join(seg.dead_line(r, error, sinks, secrets) for r, error, sinks in dead)
        error = self._append(f, data)
        if error is not None:
            # Left unacknowledged, these records are replayed by the next session instead.
            self._errors.failed(error, 0)
            return []
        f.live += len(dead)
        self.dead_letters += len(dead)
        return [r for r, _, _ in dead]

    def _ensure_file(self, kind: seg.FileKind) -> SpoolFile | None:
        current = self._active if kind == seg.SEGMENT else self._dead
        if current is not None and current.fd is not None and current.size < SEGMENT_BYTES:
            return current
        if current is not None:
            self._close_file(current)
        name = seg.new_file_name(kind, self.session, self._made)
        self._made += 1
        path = self.directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        except OSError as exc:
            self._errors.failed(describe(exc), 0)
            return None
        f = SpoolFile(self._next, name, path, kind, fd=fd, session=self.session)
        self._next += 1
        self._files[f.index] = f
        self._by_name[name] = f
        head = seg.header_line(self.project, self.run, self.session, kind)
        # A new segment starts with every tier total, so the newest one holds them all.
        state = self._books.tier_lines(None) if kind == seg.SEGMENT else b""
        error = self._append(f, head + state)
        if error is not None:
            self._errors.failed(error, 0)
            self._close_file(f)
            self._unlink(f)
            return None
        if kind == seg.SEGMENT:
            self._active = f
            if state:
                f.tiers = True
        else:
            self._dead = f
        return f

    def _append(self, f: SpoolFile, data: bytes) -> str | None:
        """Append all of `data` or nothing: a failed write is truncated away, so no torn line stays."""
        assert f.fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(f.fd, view)
                view = view[n:]
        except OSError as exc:
            try:
                os.ftruncate(f.fd, f.size)
            except OSError:
                # The partial line cannot be removed: nothing more goes into this file.
                self._close_file(f)
            return describe(exc)
        f.size += len(data)
        return None

    def _close_file(self, f: SpoolFile) -> None:
        fd, f.fd = f.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if f is self._active:
            self._active = None
        if f is self._dead:
            self._dead = None

    def _unlink(self, f: SpoolFile) -> None:
        with contextlib.suppress(FileNotFoundError):
            f.path.unlink()
        f.deleted = True

    def close(self) -> None:
        """Commit what is staged, close the files, delete what is fully acknowledged, unlock."""
        if self.closed:
            return
        try:
            self.commit()
            with self._io:
                for f in list(self._files.values()):
                    if f.fd is not None:
                        self._close_file(f)
                self._books.collect()
                self.closed = True
        finally:
            self._dir.unlock()

    def forget_setup(self) -> None:
        """The session is done (its sinks closed): its setup file goes, unless a spool file of
        its own is left, whose records recover would deliver to those sinks."""
        if self._setup is None:
            return
        own = f"-{self.session}-"
        if any(own in f.name and not f.deleted for f in list(self._files.values())):
            return
        remove_setup(self.directory, self.session)

    @property
    def io_lock(self) -> threading.Lock:
        """Held while a commit writes; a drain that needs the spool waits for it."""
        return self._io

    def unresolved(self) -> int:
        """Records the spool still holds for a later replay."""
        # list() copies in one step: a commit on another thread may add or drop files meanwhile.
        return sum(f.live for f in list(self._files.values()) if not f.deleted and f.kind == seg.SEGMENT)

    def stats(self, duplicates: int = 0) -> SpoolStats:
        files = [f for f in list(self._files.values()) if not f.deleted]  # see unresolved()
        return SpoolStats(
            directory=str(self.directory),
            durability=self.durability,
            appended=self.appended,
            acknowledged=self.acknowledged,
            unspooled=self._errors.unspooled,
            dead_letters=self.dead_letters,
            duplicates_skipped=duplicates,
            segments=len(files),
            bytes=sum(f.size for f in files),
            last_error=self._errors.last_error,
        )
