"""ParquetSink: a directory of zstd-compressed Parquet files, one schema, each file complete or absent.

Writes go to a journal first; a writer process (`_parquet_worker`) turns it into the open file's
row groups as batches arrive, and the file gets its name at a size bound; the next sink turns a
killed one's journal into a file. The schema and the file life cycle: docs/sinks.md.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import importlib.util
import os
import re
import select
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from .._checks import check_bool, check_int
from .._records.types import TraceRecord
from .._runtime import forks
from .._runtime.abandon import Backlog, run_sync_daemon
from .._security import logger
from ..exceptions import PermanentSinkError
from ._appends import write_all
from ._base import Sink
from ._guard import Guard
from ._parquet_file import FileConverter, journal_ids
from ._parquet_rows import journal_parts, pyarrow, schema

try:  # POSIX; elsewhere a journal is recovered only once its writer is gone for good
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["ParquetSink", "schema"]

_SUFFIX = ".parquet"
_JOURNAL = ".journal"
_STEM = re.compile(r"[^A-Za-z0-9._-]+")
# Errors of the output path itself that no retry fixes: a file where the directory should be.
_PERMANENT = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Seconds a closing sink waits for its writer process to exit before it kills it.
_EXIT_WAIT = 10.0
# What a close given up on leaves (the journal's path).
_LEFT = "records not in a file by then stay in {} for the next ParquetSink there or `asynctrace recover`"


def _has_pyarrow() -> None:
    """An ImportError naming the extra when pyarrow is missing; it is not imported here."""
    try:
        found = importlib.util.find_spec("pyarrow") is not None
    except ValueError:  # in sys.modules without a spec
        found = "pyarrow" in sys.modules and sys.modules["pyarrow"] is not None
    if not found:
        raise ImportError('ParquetSink needs pyarrow: pip install "asynctrace[parquet]"')


class _InThread:
    """Converts in the sink's own thread (``process=False``)."""

    def __init__(self, compression_level: int | None) -> None:
        self._converter = FileConverter(compression_level)

    def start(self, out: int, journal: int, offset: int) -> None:
        self._converter.start(out, journal, offset)

    def append(self, start: int, end: int, layout: dict[str, Any] | None) -> None:
        self._converter.append(end, layout=layout, start=start)

    def finish(self) -> int:
        return self._converter.finish()

    def ready(self) -> None:
        pyarrow()  # imported now rather than at the first row group

    def check(self) -> None:
        pass  # every call finished before it returned

    def reset(self) -> None:
        self._converter.reset()

    def close(self) -> None:
        self._converter.reset()

    def stop(self) -> str:
        # Its work is the sink's own thread's: bounded by the journal, waiting on no one.
        return "its thread goes on with the file"

    def forget(self) -> None:
        pass  # it holds no lock and keeps no other process waiting


def _worker_env() -> dict[str, str]:
    """The trainer's environment, with numpy's BLAS on one thread: the writer process does no
    linear algebra, and OpenBLAS's idle threads spin on the cores the trainer uses."""
    env = dict(os.environ)
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


class _WriterGone(RuntimeError):
    """The writer process exited (killed, out of memory): the next write starts another."""


class _WriterProcess:
    """The writer process's client. Requests are sent without waiting: the process answers each in
    order, and the sink reads the answers when it must know (a file's end) or at the next batch,
    where an earlier batch's failure fails that one (its records stay in the journal)."""

    def __init__(self, compression_level: int | None) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "asynctrace.sinks._parquet_worker",
                    str(theirs.fileno()),
                    "none" if compression_level is None else str(compression_level),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                env=_worker_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._received = b""
        self._outstanding = 1  # the process says it is ready
        self._failure: Exception | None = None
        self._last: dict[str, Any] = {}

    def _gone(self) -> _WriterGone:
        return _WriterGone(f"ParquetSink: its writer process exited (status {self._process.poll()})")

    def _send(self, request: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = orjson.dumps(request) + b"\n"
        try:
            sent = socket.send_fds(self._socket, [data], list(fds))
            if sent < len(data):  # a large layout, cut short: the descriptors went with its start
                self._socket.sendall(data[sent:])
        except (BrokenPipeError, ConnectionResetError):
            raise self._gone() from None
        self._outstanding += 1

    def _drain(self, wait: bool) -> None:
        """Read the answers that are there (all of them, with `wait`)."""
        while self._outstanding:
            if not wait and not select.select([self._socket], [], [], 0)[0]:
                return
            try:
                data = self._socket.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                raise self._gone()
            *lines, self._received = (self._received + data).split(b"\n")
            for line in lines:
                self._outstanding -= 1
                reply = orjson.loads(line)
                self._last = reply
                if not reply["ok"] and self._failure is None:
                    error = f"ParquetSink writer process: {reply['error']}"
                    code = reply.get("errno")
                    self._failure = OSError(code, error) if code is not None else RuntimeError(error)

    def ready(self) -> None:
        """Wait until the process has started (pyarrow imported)."""
        self._drain(wait=True)

    def check(self) -> None:
        """Raise the failure the process reported since the last check, if any."""
        self._drain(wait=False)
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def start(self, out: int, journal: int, offset: int) -> None:
        try:
            self._send({"op": "start", "offset": offset}, [out, journal])
        finally:
            # The process holds its own copies now.
            os.close(out)
            os.close(journal)

    def append(self, start: int, end: int, layout: dict[str, Any] | None) -> None:
        self._send({"op": "append", "start": start, "end": end, "layout": layout})

    def finish(self) -> int:
        self._send({"op": "finish"})
        self._drain(wait=True)
        self.check()
        return int(self._last["rows"])

    def reset(self) -> None:
        self._send({"op": "reset"})
        self._drain(wait=True)
        self._failure = None  # what failed is dropped with the file

    def stop(self) -> str:
        """Kill the process (from any thread): a call waiting on it fails at once."""
        with contextlib.suppress(OSError):
            self._process.kill()
        return "its writer process is killed"

    def forget(self) -> None:
        """In a forked child: close the child's copy of the socket (the parent's stays connected)."""
        self._socket.close()

    def close(self) -> None:
        """End of input: the process exits; killed when it does not in time."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        try:
            self._process.wait(_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_Converter = _InThread | _WriterProcess


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _whole_lines(fd: int) -> int:
    """Where a journal's last whole line ends (a kill may have cut the last one short)."""
    end = os.lseek(fd, 0, os.SEEK_END)
    step = 2**16
    while end > 0:
        start = max(0, end - step)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


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
    `max_records` records or `max_bytes` bytes of encoded samples (see docs/sinks.md). With
    `process` (the default) a writer process builds the file's row groups; with
    ``process=False`` the sink's own thread does.
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
        # Records (and their encoded bytes) in the journal since the last file, from byte `_base`
        # on (0 unless a journal could not be cut back after a file was named).
        self._count = 0
        self._bytes = 0
        self._base = 0
        self._journal: int | None = None  # the journal's descriptor, opened for appending
        self._converter: _Converter | None = None
        self._temporary: Path | None = None  # the file being written, under its temporary name
        self._next_index = 0
        self._known: set[str] | None = None
        # Given up on while the sink closed: the journal keeps any rows a failed last roll could
        # not write (the next sink recovers them), so any error of that release is dropped.
        self._guarded = Guard("ParquetSink", self._close_journal, Exception)
        self._backlog = Backlog("ParquetSink")
        self._released = False  # the journal's descriptor closed, by close or the last call out
        self._gave_up = False  # close was given up on: the journal is left for recovery

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
        """Turn the journals that killed sinks left in the directory into Parquet files, as
        opening a sink there does; returns how many rows they held. A live sink's is left alone."""
        if not self.directory.is_dir():
            return 0
        before = self.recovered
        self._recover()
        return self.recovered - before

    # -- files -------------------------------------------------------------------------------

    def _existing(self, stem: str) -> list[Path]:
        pattern = re.compile(rf"{re.escape(stem)}-(\d{{5,}}){re.escape(_SUFFIX)}")
        return sorted(p for p in self.directory.iterdir() if pattern.fullmatch(p.name))

    def _final(self, stem: str, index: int) -> Path:
        return self.directory / f"{stem}-{index:05d}{_SUFFIX}"

    def _create(self, final: Path) -> tuple[Path, int]:
        temporary = final.with_name(f".{final.name}.tmp")
        return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)

    def _journal_to_file(self, stem: str, journal: Path, existing: list[Path]) -> int:
        """A dead sink's journal (or this stem's own, from a killed run) as one more file of
        `stem`, in this thread, a row group at a time; the records a file holds already are left
        out (a kill between a file's naming and the journal's reset leaves them in both)."""
        stored = self._ids_in(existing)
        index = max((int(p.name[len(stem) + 1 : -len(_SUFFIX)]) for p in existing), default=-1) + 1
        final = self._final(stem, index)
        reader = os.open(journal, os.O_RDONLY | _CLOEXEC)
        converter = FileConverter(self.compression_level)
        try:
            end = _whole_lines(reader)
            temporary, out = self._create(final)
        except BaseException:
            os.close(reader)
            raise
        try:
            converter.start(out, reader)
            converter.append(end, skip=stored)
            rows = converter.finish()
            if rows:
                os.replace(temporary, final)
                _fsync_dir(self.directory)
        finally:
            converter.reset()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        return rows

    def _ids_in(self, paths: Iterable[Path], prefixes: set[str] | None = None) -> set[str]:
        if not paths:
            return set()
        pa = pyarrow()
        import pyarrow.compute as pc

        ids: set[str] = set()
        for path in paths:
            try:
                column = pa.parquet.read_table(path, columns=["id"]).column("id")
            except (OSError, KeyError, pa.lib.ArrowException):
                continue  # not one of ours (another schema, or not Parquet): it holds none of our ids
            if prefixes is not None:
                keep = None
                for prefix in prefixes:
                    hit = pc.starts_with(column, prefix + "-")
                    keep = hit if keep is None else pc.or_(keep, hit)
                if keep is not None:
                    column = column.filter(keep)
            ids.update(column.to_pylist())
        return ids

    def _recover(self) -> None:
        """Turn the journals of sinks that are gone (killed) into files; a live sink's is locked."""
        for journal in sorted(self.directory.glob(f".*{_JOURNAL}")):
            stem = journal.name[1 : -len(_JOURNAL)]
            if stem == self.stem or not journal.is_file():
                continue
            try:
                f = open(journal, "rb+")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                continue
            with f:
                if fcntl is not None:
                    try:
                        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its sink is still running
                self.recovered += self._journal_to_file(stem, journal, self._existing(stem))
                # A file the kill cut short never got its final name: only its temporary goes.
                for temporary in self.directory.glob(f".{glob.escape(stem)}-*{_SUFFIX}.tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temporary)
                os.unlink(journal)

    def _open_once(self) -> None:
        if self._journal is not None:
            return
        if self.stem is None:
            self.stem = _unique_stem("run")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not self.directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.directory))
            self._recover()
            path = self.directory / f".{self.stem}{_JOURNAL}"
            # Unbuffered: a failed append leaves nothing in a buffer to be written later, and
            # cutting the file back undoes it.
            journal = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _CLOEXEC, 0o644)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise PermanentSinkError(
                            f"ParquetSink: another sink writes with stem {self.stem!r} in {self.directory}"
                        ) from None
                if os.lseek(journal, 0, os.SEEK_END):
                    # This stem's own journal from a killed run (a fixed stem): a file first.
                    self.recovered += self._journal_to_file(self.stem, path, self._existing(self.stem))
                    os.ftruncate(journal, 0)
                existing = self._existing(self.stem)
                if existing:
                    self._next_index = int(existing[-1].name[len(self.stem) + 1 : -len(_SUFFIX)]) + 1
                if self._converter is None:
                    # Started now: a sink that is open is ready to write at full speed.
                    self._converter = self._new_converter()
                    self._converter.ready()
            except BaseException:
                os.close(journal)
                raise
            self._journal = journal
            forks.hold(self, self._after_fork_in_child)
        except OSError as exc:
            raise _permanent(exc, self.directory) or exc from exc

    def _new_converter(self) -> _Converter:
        if self.process and hasattr(socket, "send_fds"):
            return _WriterProcess(self.compression_level)
        return _InThread(self.compression_level)

    def _convert(self, start: int, end: int, layout: dict[str, Any] | None) -> None:
        """The journal's lines up to `end` into the open file, which is started first if need be
        (`layout`: that of the batch written from `start` on, if known)."""
        assert self.stem is not None
        if self._converter is None:
            self._converter = self._new_converter()
        if self._temporary is None:
            temporary, out = self._create(self._final(self.stem, self._next_index))
            self._temporary = temporary
            try:
                reader = os.open(self.directory / f".{self.stem}{_JOURNAL}", os.O_RDONLY | _CLOEXEC)
            except BaseException:
                os.close(out)
                raise
            self._converter.start(out, reader, self._base)
        self._converter.append(start, end, layout)
        # An earlier batch's conversion that failed fails this one: the file starts again.
        self._converter.check()

    def _discard(self) -> None:
        """Drop the file being written (its records stay in the journal, to be converted again)."""
        temporary, self._temporary = self._temporary, None
        converter = self._converter
        if converter is not None:
            try:
                converter.reset()
            except Exception:
                # A writer process that cannot answer is replaced by a fresh one.
                self._converter = None
                with contextlib.suppress(Exception):
                    converter.close()
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def _roll(self) -> None:
        """Close the open file and give it its name: the commit point of its records."""
        assert self.stem is not None and self._converter is not None and self._temporary is not None
        rows = self._converter.finish()
        if rows != self._count:
            raise RuntimeError(f"ParquetSink: the file holds {rows} records, the journal {self._count}")
        final = self._final(self.stem, self._next_index)
        os.replace(self._temporary, final)
        self._temporary = None
        self._next_index += 1
        self.paths.append(final)
        self._count = self._bytes = 0
        # The records are in a named file now: nothing below may fail the batch, or its retry
        # would write them twice. A kill before the journal's reset is undone by recovery's id
        # check; a reset that fails moves the next file's start past them.
        journal = self._journal
        try:
            _fsync_dir(self.directory)
            if journal is not None:
                os.ftruncate(journal, 0)
                self._base = 0
        except OSError:
            if journal is not None:
                self._base = os.lseek(journal, 0, os.SEEK_END)

    def _write(self, records: Sequence[TraceRecord]) -> None:
        journal = self._journal
        if journal is None:
            raise RuntimeError("ParquetSink is not open")
        if any(r.replayed for r in records):
            records = self._unseen(records)
            if not records:
                return
        parts, layout = journal_parts(records)
        length = sum(map(len, parts))
        start = os.lseek(journal, 0, os.SEEK_END)
        count, size = self._count, self._bytes
        try:
            write_all(journal, parts)
            if self.fsync:
                os.fsync(journal)
            self._count += len(records)
            self._bytes += sum(layout["sizes"])
            self._convert(start, start + length, layout)
            if self._count >= self.max_records or self._bytes >= self.max_bytes:
                self._roll()
        except BaseException as exc:
            # Nothing of this batch may stay behind: the retry writes it again. The file being
            # written may hold some of it: it is started again from the journal.
            self._count, self._bytes = count, size
            self._discard()
            with contextlib.suppress(OSError):
                os.ftruncate(journal, start)
            if isinstance(exc, OSError):
                raise _permanent(exc, self.directory) or exc from exc
            raise
        if self._known is not None:
            self._known.update(r.id for r in records)

    def _unseen(self, records: Sequence[TraceRecord]) -> list[TraceRecord]:
        """Replayed records that no file or journal here holds yet (a spool replays what a kill cut off)."""
        if self._known is None:
            prefixes = {r.id.rpartition("-")[0] for r in records if r.replayed}
            files = [p for p in self.directory.iterdir() if p.name.endswith(_SUFFIX) and p.name[0] != "."]
            self._known = self._ids_in(files, prefixes) | self._journal_ids()
        known = self._known
        batch: set[str] = set()
        out = []
        for r in records:
            if not (r.replayed and (r.id in known or r.id in batch)):
                out.append(r)
                batch.add(r.id)
        self.duplicates_skipped += len(records) - len(out)
        return out

    def _journal_ids(self) -> set[str]:
        """The ids of the records in this sink's journal since its last file."""
        if not self._count:
            return set()
        reader = os.open(self.directory / f".{self.stem}{_JOURNAL}", os.O_RDONLY | _CLOEXEC)
        try:
            return journal_ids(reader, self._base, os.lseek(reader, 0, os.SEEK_END))
        finally:
            os.close(reader)

    def _close_journal(self) -> None:
        journal, self._journal = self._journal, None
        forks.release(self)
        try:
            if journal is None:
                return
            try:
                if self._count and self._gave_up:
                    raise RuntimeError("ParquetSink: closing was given up on")
                if self._count and self._temporary is None:  # a failed write dropped the file
                    self._convert(self._base, os.lseek(journal, 0, os.SEEK_END), None)
                if self._count:
                    self._roll()
            except BaseException:
                self._discard()  # the journal keeps the records: the next sink recovers them
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / f".{self.stem}{_JOURNAL}")
        finally:
            if journal is not None:
                os.close(journal)
            converter, self._converter = self._converter, None
            if converter is not None:
                converter.close()
            self._released = True

    def _after_fork_in_child(self) -> None:
        # fork shares the journal's open file (so its lock) and the writer's socket: a child outliving
        # a killed trainer would keep the journal locked against recovery and the writer waiting.
        # Closing the child's copies leaves the parent's as they are (unlocking would not).
        journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(OSError):
                os.close(journal)
        if self._converter is not None:
            self._converter.forget()

    def _give_up(self) -> str:
        """Kill the writer process: a call waiting on it fails and lets go of the journal."""
        self._gave_up = True
        converter = self._converter
        said = converter.stop() if converter is not None else "no writer process was running"
        return f"{said}; {_LEFT.format(self.directory / f'.{self.stem}{_JOURNAL}')}"

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
