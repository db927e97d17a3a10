"""ParquetSink: a directory of zstd-compressed Parquet files, one schema, each file complete or absent.

A write appends its records to the journal of the file being filled (the commit point); the
sink's file maker (`_parquet_maker`) turns each journal into its file, off the write path, with
a writer process (`_parquet_worker`) doing the conversion. The next sink, or recovery, turns a
killed one's journals into files (`_parquet_recovery`). The schema and the file life cycle:
docs/sinks/parquet.md.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib.util
import os
import re
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._checks import check_bool, check_int
from .._records.types import TraceRecord
from .._runtime import forks
from .._runtime.abandon import Backlog, run_sync_daemon
from .._security import logger
from ..exceptions import PermanentSinkError
from ._appends import write_all
from ._base import Sink
from ._guard import Guard
from ._parquet_file import file_ids, journal_ids
from ._parquet_journal import DamagedJournal, Journal, JournalName, create, fsync_dir, next_index
from ._parquet_maker import FileMaker
from ._parquet_recovery import recover_journals
from ._parquet_rows import journal_parts, schema
from ._parquet_sidecar import remove_leftovers

__all__ = ["DamagedJournal", "ParquetSink", "schema"]

_SUFFIX = ".parquet"
_STEM = re.compile(r"[^A-Za-z0-9._-]+")
# Errors of the output path itself that no retry fixes: a file where the directory should be.
_PERMANENT = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)
# Journals waiting for the file maker, at most: while it is that far behind (a writer process
# stopped or slow), the open file grows past its bounds instead of a new journal being opened.
_WAITING = 16
# What a close given up on leaves.
_LEFT = "records not in a file by then stay in {} for the next ParquetSink there or `asynctrace recover`"


def _has_pyarrow() -> None:
    """An ImportError naming the extra when pyarrow is missing; it is not imported here."""
    try:
        found = importlib.util.find_spec("pyarrow") is not None
    except ValueError:  # in sys.modules without a spec
        found = "pyarrow" in sys.modules and sys.modules["pyarrow"] is not None
    if not found:
        raise ImportError('ParquetSink needs pyarrow: pip install "asynctrace[parquet]"')


def _unique_stem(run: str) -> str:
    """A stem no other session's files share: the run name, the start time and a random part."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{_STEM.sub('-', run)[:64] or 'run'}-{started}-{uuid.uuid4().hex[:8]}"


def _permanent(exc: OSError, directory: Path) -> PermanentSinkError | None:
    if exc.errno in _PERMANENT:
        return PermanentSinkError(f"ParquetSink: {directory} cannot hold the archive: {exc}")
    return None


class ParquetSink(Sink):
    """Writes every record to zstd-compressed Parquet files in `directory`, one schema for all.

    A file (``<stem>-<n>.parquet``) is rolled over at the first batch boundary once it holds
    `max_records` records or `max_bytes` bytes of encoded samples (see docs/sinks/parquet.md). With
    `process` (the default) a writer process builds the file's row groups; with
    ``process=False`` a thread of the sink's own does.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_records: int = 100_000,
        max_bytes: int = 256 * 2**20,
        compression_level: int | None = None,
        stem: str | None = None,
        fsync: bool = False,
        process: bool = True,
    ) -> None:
        _has_pyarrow()
        check_int("max_records", max_records)
        check_int("max_bytes", max_bytes)
        check_int("compression_level", compression_level, allow_none=True)
        check_bool("fsync", fsync)
        check_bool("process", process)
        if max_records < 1 or max_bytes < 1:
            raise ValueError("max_records and max_bytes must be at least 1")
        if stem is not None and (
            not isinstance(stem, str) or not stem or stem.startswith(".") or _STEM.search(stem)
        ):
            raise ValueError(f"stem: expected letters, digits, '.', '_' or '-', got {stem!r}")
        self.name = "parquet"
        self._given_stem = stem
        self.directory = Path(directory)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.compression_level = compression_level
        self.fsync = fsync
        self.process = process
        self.stem = stem
        self.paths: list[Path] = []
        self.duplicates_skipped = 0
        self.recovered = 0
        # Journals not taken whole (damaged lines, or left as they are): dead sinks' at recovery,
        # and its own, once closed.
        self.damaged_journals: list[DamagedJournal] = []
        # This sink's journals whose files are not named yet (each open, locked), oldest first,
        # and the one batches go to now.
        self._journals: list[Journal] = []
        self._current: Journal | None = None
        self._maker: FileMaker | None = None
        self._next_index = 0
        self._known: set[str] | None = None
        # Given up on while the sink closed: the journals keep what is not in a file (the next
        # sink recovers them), so any error of that release is dropped.
        self._guarded = Guard("ParquetSink", self._release, Exception)
        self._backlog = Backlog("ParquetSink")
        self._released = False  # the journals closed, by close or the last call out
        self._gave_up = False  # close was given up on: the journals are left for recovery

    def bind(self, project: str, run: str) -> None:
        if self.stem is None:
            self.stem = _unique_stem(run)

    def recovery_args(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory.absolute()),
            "max_records": self.max_records,
            "max_bytes": self.max_bytes,
            "compression_level": self.compression_level,
            "stem": self._given_stem,
            "fsync": self.fsync,
        }

    def finalize_journals(self) -> int:
        """Turn the journals that killed sinks left in the directory into Parquet files, and
        remove the temporaries that killed sidecar makers left, as opening a sink there does;
        returns how many rows they held (damaged lines skipped are in `damaged_journals`). A
        live sink's journal, and a live maker's temporary, are left alone."""
        if not self.directory.is_dir():
            return 0
        before = self.recovered
        self._recover(own=None)
        return self.recovered - before

    # -- files -------------------------------------------------------------------------------

    def _recover(self, own: str | None) -> None:
        """Turn the journals of sinks that are gone (killed) into files; a live sink's is locked
        (with the stem `own`: a `PermanentSinkError`, two sinks cannot share it)."""
        found = recover_journals(self.directory, self.compression_level, own)
        # A sidecar maker killed with the trainer leaves its temporaries: no one else removes them.
        remove_leftovers(self.directory)
        self.recovered += found.rows
        self.damaged_journals += found.damaged

    def _open_once(self) -> None:
        if self._maker is not None:
            return
        if self._released:
            raise RuntimeError("ParquetSink is closed")
        if self.stem is None:
            self.stem = _unique_stem("run")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not self.directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.directory))
            self._recover(own=self.stem)
            self._next_index = next_index(self.directory, self.stem)
            # Started now: a sink that is open is ready to write at full speed. Held before it
            # is ready, so that a close given up on can kill a writer process that never is.
            maker = self._maker = FileMaker(
                self.directory, self.stem, self.compression_level, self.process, self.paths
            )
            try:
                maker.start()
            except BaseException:
                self._maker = None
                maker.stop()
                raise
            forks.hold(self, self._after_fork_in_child)
        except OSError as exc:
            raise _permanent(exc, self.directory) or exc from exc

    def _journal(self) -> Journal:
        """The journal batches go to now: a new one (locked, its header written) after a file's end."""
        if self._current is not None:
            return self._current
        assert self.stem is not None
        try:
            journal = create(self.directory, JournalName(self.stem, self._next_index))
        except FileExistsError:
            raise PermanentSinkError(
                f"ParquetSink: another sink writes with stem {self.stem!r} in {self.directory}"
            ) from None
        self._next_index += 1
        self._journals.append(journal)
        self._current = journal
        if self.fsync:  # the journal's name too, before a record in it counts as written
            fsync_dir(self.directory)
        return journal

    def _reap(self) -> None:
        """Close the journals whose files the maker has named (their names are gone already)."""
        if self._maker is None:
            return
        done = self._maker.take_done()
        for journal in done:
            os.close(journal.fd)
        if done:
            self._journals = [j for j in self._journals if j not in done]

    def _write(self, records: Sequence[TraceRecord]) -> None:
        maker = self._maker
        if maker is None:
            raise RuntimeError("ParquetSink is not open")
        self._reap()
        if any(r.replayed for r in records):
            records = self._unseen(records)
            if not records:
                return
        parts, layout = journal_parts(records)
        try:
            journal = self._journal()
            start = journal.end
            if os.lseek(journal.fd, 0, os.SEEK_END) != start:  # an earlier cut back failed
                os.ftruncate(journal.fd, start)
            try:
                write_all(journal.fd, parts)
                if self.fsync:
                    os.fsync(journal.fd)
            except BaseException:
                # Nothing of this batch may stay behind: the retry writes it again.
                with contextlib.suppress(OSError):
                    os.ftruncate(journal.fd, start)
                raise
        except OSError as exc:
            raise _permanent(exc, self.directory) or exc from exc
        # Written: the journal holds the batch. What follows never fails or waits.
        journal.end = start + sum(map(len, parts))
        journal.count += len(records)
        journal.nbytes += sum(layout["sizes"])
        maker.append(journal, start, journal.end, layout)
        full = journal.count >= self.max_records or journal.nbytes >= self.max_bytes
        if full and len(self._journals) <= _WAITING:
            maker.finish(journal)
            self._current = None
        if self._known is not None:
            self._known.update(r.id for r in records)

    def _unseen(self, records: Sequence[TraceRecord]) -> list[TraceRecord]:
        """Replayed records that no file or journal here holds yet (a spool replays what a kill cut off)."""
        if self._known is None:
            prefixes = {r.id.rpartition("-")[0] for r in records if r.replayed}
            # The journals first: a file named meanwhile holds what its journal did.
            journals = set().union(*(journal_ids(j.fd, j.start, j.end) for j in self._journals))
            files = [p for p in self.directory.iterdir() if p.name.endswith(_SUFFIX) and p.name[0] != "."]
            self._known = file_ids(files, prefixes) | journals
        known = self._known
        batch: set[str] = set()
        out = []
        for r in records:
            if not (r.replayed and (r.id in known or r.id in batch)):
                out.append(r)
                batch.add(r.id)
        self.duplicates_skipped += len(records) - len(out)
        return out

    def _release(self) -> None:
        """The last call: the files of every journal made and named; those that cannot be stay
        as journals (unlocked here), for the next sink or recovery."""
        current, self._current = self._current, None
        maker = self._maker
        forks.release(self)
        try:
            if current is not None and not current.count:  # opened by a write that failed
                with contextlib.suppress(OSError):
                    os.unlink(current.path)
                os.close(current.fd)
                self._journals.remove(current)
            elif current is not None and maker is not None:
                maker.finish(current)
            if maker is not None:
                maker.stop()
                self._reap()
                self.damaged_journals += maker.damaged  # its own journals' (a disk's damage)
            if self._journals:
                paths = ", ".join(str(j.path) for j in self._journals)
                if self._gave_up:
                    raise RuntimeError(f"ParquetSink: closing was given up on; {_LEFT.format(paths)}")
                why = maker.last_error if maker is not None else "not open"
                raise RuntimeError(f"ParquetSink: files not made ({why}); {_LEFT.format(paths)}")
        finally:
            journals, self._journals = self._journals, []
            for journal in journals:
                with contextlib.suppress(OSError):
                    os.close(journal.fd)
            self._released = True

    def _after_fork_in_child(self) -> None:
        # fork shares the journals' open files (so their locks) and the writer's socket: a child
        # outliving a killed trainer would keep the journals locked against recovery and the
        # writer waiting. Closing the child's copies leaves the parent's as they are (unlocking
        # would not).
        journals, self._journals, self._current = self._journals, [], None
        for journal in journals:
            with contextlib.suppress(OSError):
                os.close(journal.fd)
        if self._maker is not None:
            self._maker.forget()

    def _give_up(self) -> str:
        """Stop the maker, killing the writer process: a call waiting on it fails and lets go."""
        self._gave_up = True
        said = self._maker.give_up() if self._maker is not None else "no writer process was running"
        paths = ", ".join(str(j.path) for j in list(self._journals)) or f"the journals in {self.directory}"
        return f"{said}; {_LEFT.format(paths)}"

    # -- threads -----------------------------------------------------------------------------

    async def open(self) -> None:
        await run_sync_daemon(self._guarded, self._open_once, backlog=self._backlog)

    async def write(self, records: Sequence[TraceRecord]) -> None:
        await run_sync_daemon(self._guarded, self._write, records, backlog=self._backlog)

    async def close(self) -> None:
        try:
            await run_sync_daemon(self._guarded.close)
        except BaseException:
            if not self._released:  # cancelled at the session's close deadline
                logger.error("ParquetSink: closing was given up on; %s", self._give_up())
            raise
        if not self._released:  # a call given up on earlier is still out (it releases)
            raise RuntimeError(f"ParquetSink: closed with a call still out; {self._give_up()}")
