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
`books.py`; making, appending to and closing the files by `files.py`. A segment is deleted when
none of its records is unresolved and every segment it holds acknowledgements for is gone
(deleting it earlier would bring those records back on replay); a session's newest segment with
tier lines also stays while any file of that session holds unresolved records (their replay
needs what the tiers had done).
A failed write (a full disk) truncates the partial line away, counts the records as
``unspooled`` and logs one error: the records are still delivered to the sinks.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .._records.types import TraceRecord
from .._security import describe, logger, secret_bytes
from .._stats import SpoolStats
from ..exceptions import SpoolError
from . import segments as seg
from .books import Books
from .directory import SpoolDir
from .files import SpoolFiles
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
_TIER = 4  # a tier's progress (error: the sink's name)

# A tier's progress: (records written per (split, step), each split's closed prefix, whether the
# counts are totals rather than deltas); see `Spool.tier`.
_TierNote = tuple[dict[tuple[str, int], int], dict[str, int], bool]


class _Op(NamedTuple):
    """One staged operation, committed in the order it was staged."""

    kind: int
    records: Sequence[TraceRecord]
    error: str | None  # a dead letter's error; a sink or tier line's sink name
    sinks: Sequence[str]  # a dead letter's failed sinks
    lines: list[bytes] | None  # the records' lines, when staged encoded
    tier: _TierNote | None  # a tier line's progress


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
        self._files = SpoolFiles(
            self.directory,
            self._books,
            project=project,
            run=run,
            session=session,
            segment_bytes=SEGMENT_BYTES,
        )
        self._errors = self._files.errors
        self._ops: list[_Op] = []
        self._plock = threading.Lock()  # guards _ops; taken under the buffer lock
        self._io = threading.Lock()  # one commit at a time, in order
        # `within`: the lock `asynctrace recover` holds for all its sessions (see SpoolDir).
        self._dir = SpoolDir(self.directory, within=within)
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
                self._files.register(f)
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

    def backlog(
        self, scan: seg.DirScan, match: Callable[[seg.FileScan], bool]
    ) -> Iterator[list[TraceRecord]]:
        """The unresolved records of the files `match` selects, one file at a time, ready to replay."""
        for fs in scan.files:
            if not fs.usable or not fs.unresolved or not match(fs):
                continue
            f = self._files.named(fs.name)
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
            self._ops.append(_Op(_STAGE, fresh, None, (), lines, None))

    def resolve(
        self, records: Sequence[TraceRecord], error: str | None = None, sinks: Sequence[str] = ()
    ) -> None:
        """Records are done: written or dropped (`error` None), or failed for good (dead letters)."""
        with self._plock:
            self._ops.append(_Op(_ACK if error is None else _DEAD, records, error, sinks, None, None))

    def sink_done(self, records: Sequence[TraceRecord], sink: str) -> None:
        """One sink (its name in the session) dealt with records that others may not have yet."""
        with self._plock:
            self._ops.append(_Op(_SINK, records, sink, (), None, None))

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
            self._ops.append(_Op(_TIER, (), sink, (), None, (dict(written), dict(closed), absolute)))

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
        active = self._files.ensure(seg.SEGMENT)
        target = active.index if active is not None else UNSPOOLED
        lines: list[bytes] = []
        fresh: list[TraceRecord] = []
        done: list[TraceRecord] = []
        dead: list[tuple[TraceRecord, str, Sequence[str]]] = []
        partial: dict[str, list[TraceRecord]] = {}
        tiers: dict[str, tuple[set[tuple[str, int]], set[str]]] = {}
        lost = 0
        for kind, records, error, sinks, encoded, tier in ops:
            if kind == _SINK:
                assert error is not None
                partial.setdefault(error, []).extend(records)
                continue
            if kind == _TIER:
                assert error is not None
                assert tier is not None
                written, closed, absolute = tier
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
            error = self._files.append(active, b"".join(lines) + acks)
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
        table = self._files.table
        for r in done:
            where = r.spool_slot
            if where is not None and where >= 0:
                f = table.get(where)
                if f is not None:
                    f.live -= 1
                    self.acknowledged += 1
        self._books.collect()

    def _write_dead(
        self, dead: list[tuple[TraceRecord, str, Sequence[str]]], secrets: list[bytes]
    ) -> list[TraceRecord]:
        """Append dead letters; returns the records now safely there (to acknowledge)."""
        f = self._files.ensure(seg.DEAD)
        if f is None:
            return []
        data = b"".join(seg.dead_line(r, error, sinks, secrets) for r, error, sinks in dead)
        error = self._files.append(f, data)
        if error is not None:
            # Left unacknowledged, these records are replayed by the next session instead.
            self._errors.failed(error, 0)
            return []
        f.live += len(dead)
        self.dead_letters += len(dead)
        return [r for r, _, _ in dead]

    def close(self) -> None:
        """Commit what is staged, close the files, delete what is fully acknowledged, unlock."""
        if self.closed:
            return
        try:
            self.commit()
            with self._io:
                self._files.close_all()
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
        if any(own in f.name for f in self._files.present()):
            return
        remove_setup(self.directory, self.session)

    @property
    def io_lock(self) -> threading.Lock:
        """Held while a commit writes; a drain that needs the spool waits for it."""
        return self._io

    def unresolved(self) -> int:
        """Records the spool still holds for a later replay."""
        return sum(f.live for f in self._files.present() if f.kind == seg.SEGMENT)

    def stats(self, duplicates: int = 0) -> SpoolStats:
        files = self._files.present()
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
