"""ParquetSink's file maker: a thread of the sink's own that turns each journal into its named
file, off the write path.

A write ends at the journal (its commit point, what "written" means) and hands the maker what to
do without waiting: the journal's bytes as they grow (`append`) and, once the file is full or the
sink closes, its end (`finish`). The maker drives the converter (`_parquet_client`), renames the
finished file to `<stem>-<n>.parquet`, syncs the directory, removes the journal and writes the
file's sidecars for the viewer (`_parquet_sidecar`). So a writer
process that is stopped, slow or killed never fails, delays or duplicates a write: the journal
holds the batch once whatever the maker does later. A file whose conversion fails (its writer
process killed, a directory refusing the temporary) is made again from its journal with a fresh
converter, up to three times; one that still fails is left as its journal, tried again after the
next file is made and at close, and otherwise left to the next sink or recovery.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .._security import logger
from ._parquet_client import Converter, new_converter, worker_env
from ._parquet_journal import CLOEXEC, DamagedJournal, Journal, fsync_dir
from ._parquet_sidecar import write_sidecar, write_sidecar_apart

__all__ = ["FileMaker"]

# Seconds to wait before each try at a file: a killed writer process is replaced at once.
_PAUSES = (0.0, 0.2, 1.0)
# Rows of batch layouts that requests waiting for the maker may hold; past it (the converter far
# behind) requests go without one, and the converter cuts those lines itself.
_LAYOUT_ROWS = 50_000
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _Append(NamedTuple):
    journal: Journal
    start: int
    end: int
    layout: dict[str, Any] | None


class _Finish(NamedTuple):
    journal: Journal
    end: int
    records: int


@dataclass(slots=True)
class _File:
    """A file being made from its journal: how far the journal goes and how many records it holds."""

    journal: Journal
    temporary: Path
    end: int
    count: int = 0
    started: bool = False  # the converter holds it
    broken: bool = False  # its conversion failed: it is made again from the journal at its end


def _rows(layout: dict[str, Any] | None) -> int:
    return len(layout["ids"]) if layout is not None else 0


def _merged(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """The layout of two batches written one after the other (None unless both have one)."""
    if first is None or second is None:
        return None
    return {key: first[key] + second[key] for key in first}


class FileMaker:
    """Makes a sink's files from its journals, in order, on its own thread (see the module)."""

    def __init__(
        self, directory: Path, stem: str, compression_level: int | None, process: bool, paths: list[Path]
    ) -> None:
        self.directory = directory
        self.stem = stem
        self.compression_level = compression_level
        self.process = process
        self.paths = paths  # the sink's list of the files it wrote
        self.damaged: list[DamagedJournal] = []
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._ops: deque[_Append | _Finish | None] = deque()
        self._layout_rows = 0
        self._done: list[Journal] = []
        self._left: list[_File] = []
        self._file: _File | None = None
        self._converter: Converter | None = None
        self._halt = threading.Event()
        # Set once the sink closes: sidecars are then skipped (and one being made is stopped), so
        # that a close never waits for what only saves the viewer time.
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the converter (a writer process is waited for until it is ready) and the thread."""
        self._converter = new_converter(self.process, self.compression_level)
        self._converter.ready()
        self._thread = threading.Thread(target=self._run, name="asynctrace-parquet", daemon=True)
        self._thread.start()

    # -- the sink's side: none of these waits for the conversion ---------------------------------

    def append(self, journal: Journal, start: int, end: int, layout: dict[str, Any] | None) -> None:
        """The journal's bytes from `start` to `end` (a batch written with `layout`) go to its file."""
        with self._cond:
            last = self._ops[-1] if self._ops else None
            if isinstance(last, _Append) and last.journal is journal and last.end == start:
                # Requests the maker has not reached yet become one.
                self._ops.pop()
                self._layout_rows -= _rows(last.layout)
                start, layout = last.start, _merged(last.layout, layout)
            if self._layout_rows + _rows(layout) > _LAYOUT_ROWS:
                layout = None
            self._layout_rows += _rows(layout)
            self._ops.append(_Append(journal, start, end, layout))
            self._cond.notify()

    def finish(self, journal: Journal) -> None:
        """The journal is complete: its file is to be ended and named."""
        with self._cond:
            self._ops.append(_Finish(journal, journal.end, journal.count))
            self._cond.notify()

    def take_done(self) -> list[Journal]:
        """The journals whose files are named since the last call (the sink closes them)."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def stop(self) -> None:
        """Make what was handed over, then end the thread and the converter (this waits)."""
        self._closing.set()
        with self._cond:
            self._ops.append(None)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        elif self._converter is not None:  # started no thread: its open failed
            self._converter.close()

    def give_up(self) -> str:
        """Stop at once (from any thread): the writer process is killed, and what is not made by
        then stays in its journals."""
        self._closing.set()
        self._halt.set()
        with self._cond:
            self._cond.notify()
        converter = self._converter
        return converter.stop() if converter is not None else "no writer process was running"

    def forget(self) -> None:
        """In a forked child (which has no copy of the thread): let go of the writer's socket."""
        converter = self._converter
        if converter is not None:
            converter.forget()

    # -- the thread ----------------------------------------------------------------------------

    def _next(self) -> _Append | _Finish | None:
        with self._cond:
            while not self._ops and not self._halt.is_set():
                self._cond.wait()
            if self._halt.is_set():
                return None
            op = self._ops.popleft()
            if isinstance(op, _Append):
                self._layout_rows -= _rows(op.layout)
            return op

    def _run(self) -> None:
        try:
            while (op := self._next()) is not None:
                try:
                    if isinstance(op, _Append):
                        self._append(op)
                    elif self._make(self._take(op)) and self._left:
                        self._retry_left()  # what failed earlier may work now
                except Exception as exc:  # never the end of the thread: the journal stays
                    logger.error("ParquetSink: its file maker failed: %s: %s", type(exc).__name__, exc)
            self._retry_left()
        finally:
            if self._file is not None:
                self._drop(self._file)
            converter, self._converter = self._converter, None
            if converter is not None:
                with contextlib.suppress(Exception):
                    converter.close()

    def _file_of(self, journal: Journal, end: int) -> _File:
        f = self._file
        if f is None or f.journal is not journal:
            if f is not None:  # cannot happen: a journal is finished before the next one starts
                self._drop(f)
            final = f".{self.stem}-{journal.index:05d}.parquet.tmp"
            f = self._file = _File(journal, self.directory / final, end)
        f.end = end
        return f

    def _take(self, op: _Finish) -> _File:
        f = self._file_of(op.journal, op.end)
        f.count = op.records
        self._file = None
        return f

    def _append(self, op: _Append) -> None:
        f = self._file_of(op.journal, op.end)
        if f.broken:
            return  # made again from its journal at its end
        try:
            converter = self._start(f)
            converter.append(op.start, op.end, op.layout)
            converter.check()
        except Exception as exc:
            self._fail(f, exc)

    def _start(self, f: _File) -> Converter:
        """The converter, holding `f` (started from the journal's first record if it was not)."""
        converter = self._converter
        if converter is None:
            converter = self._converter = new_converter(self.process, self.compression_level)
            converter.ready()
        if f.started:
            return converter
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | CLOEXEC | _NOFOLLOW
        out = os.open(f.temporary, flags, 0o644)
        try:
            # The journal as the sink holds it open, not by its name: what the name leads to
            # (removed, or replaced by another file) is never read as the journal.
            reader = os.dup(f.journal.fd)
        except BaseException:
            os.close(out)
            raise
        converter.start(out, reader, f.journal.start)
        f.started = True
        return converter

    def _make(self, f: _File) -> bool:
        """End and name `f`'s file, trying again from its journal; False when left as its journal."""
        error: Exception | None = None
        for pause in _PAUSES:
            if self._halt.wait(pause):
                return False
            try:
                if not f.started or f.broken:
                    f.broken = False
                    self._start(f).append(f.journal.start, f.end, None)
                assert self._converter is not None
                made = self._converter.finish()
                f.started = False
                if made.rows + made.damaged != f.count:
                    raise RuntimeError(
                        f"ParquetSink: the file holds {made.rows} records and {made.damaged} damaged "
                        f"lines, its journal {f.count}"
                    )
                self._name(f, made.rows, made.damaged)
                if made.rows and not self._closing.is_set():
                    # What `asynctrace view` would compute at its first open, once, here; never
                    # fails. With a writer process, in a process of its own too. Not once the
                    # sink closes: the viewer computes what a file lacks.
                    named = self.directory / f"{self.stem}-{f.journal.index:05d}.parquet"
                    if self.process:
                        write_sidecar_apart(named, self._closing, worker_env())
                    else:
                        write_sidecar(named)
                return True
            except Exception as exc:
                error = exc
                self._fail(f, exc)
        if not self._halt.is_set():
            self._left.append(f)
            self.last_error = f"{type(error).__name__}: {error}"
            logger.warning(
                "ParquetSink: the file of %s could not be made (%s); its records stay in that journal, "
                "tried again later, else for the next ParquetSink there or `asynctrace recover`",
                f.journal.path,
                self.last_error,
            )
        return False

    def _retry_left(self) -> None:
        left, self._left = self._left, []
        for f in left:
            self._make(f)

    def _name(self, f: _File, rows: int, damaged: int) -> None:
        """Give the finished file its name: the records are in a named file from here on, so
        nothing after may fail (a kill before the journal is removed is undone by recovery)."""
        final = self.directory / f"{self.stem}-{f.journal.index:05d}.parquet"
        if rows:
            os.replace(f.temporary, final)
        else:  # every line damaged: no file
            os.unlink(f.temporary)
        with contextlib.suppress(OSError):
            fsync_dir(self.directory)
        with contextlib.suppress(OSError):
            os.unlink(f.journal.path)
        with self._cond:
            self._done.append(f.journal)
            if rows:
                self.paths.append(final)
        if damaged:
            self.damaged.append(DamagedJournal(f.journal.path, damaged))
            logger.warning(
                "ParquetSink: %d damaged lines of %s skipped (their records are lost)",
                damaged,
                f.journal.path,
            )

    def _fail(self, f: _File, exc: Exception) -> None:
        """Drop the file being made (made again from its journal); a converter that cannot say
        so, a writer process gone or stopped answering, is replaced by a fresh one."""
        f.broken, f.started = True, False
        self.last_error = f"{type(exc).__name__}: {exc}"
        converter = self._converter
        if converter is not None:
            try:
                if self._halt.is_set():
                    raise RuntimeError("given up on")
                converter.reset()
            except Exception:
                self._converter = None
                with contextlib.suppress(Exception):
                    converter.close()
        with contextlib.suppress(OSError):
            os.unlink(f.temporary)

    def _drop(self, f: _File) -> None:
        if f.started:
            self._fail(f, RuntimeError("closed"))
