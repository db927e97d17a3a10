"""ParquetSink: a directory of zstd-compressed Parquet files, one schema, each file complete or absent.

Writes go to a journal first, which becomes a Parquet file at a size bound; the next sink turns a
killed one's journal into a file. The schema and the file life cycle: docs/sinks.md.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from .._checks import check_bool, check_int, int64_or_none
from .._records.tokens import TOKEN_FIELDS, token_bytes
from .._records.types import TraceRecord
from .._runtime.abandon import Backlog, run_sync_daemon
from ..exceptions import PermanentSinkError
from ._base import Sink
from ._guard import Guard

try:  # POSIX; elsewhere a journal is recovered only once its writer is gone for good
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["ParquetSink"]

_SUFFIX = ".parquet"
_JOURNAL = ".journal"
_STEM = re.compile(r"[^A-Za-z0-9._-]+")
# Errors of the output path itself that no retry fixes: a file where the directory should be.
_PERMANENT = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)
_ARROW_TYPES = {"int32": "int32", "int8": "int8", "float32": "float32"}


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError('ParquetSink needs pyarrow: pip install "asynctrace[parquet]"') from exc
    return pyarrow


def schema() -> Any:
    """The one schema of every file a `ParquetSink` writes."""
    pa = _pyarrow()
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("messages", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("policy_version", pa.int64()),
        pa.field("stop_reason", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("spans", pa.string()),
    ]
    for name, dtype in TOKEN_FIELDS.items():
        fields.append(pa.field(name, pa.list_(getattr(pa, _ARROW_TYPES[dtype])())))
    return pa.schema(fields)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# A row as the journal holds it: id, step, split, key, timestamp and the sample's JSON.
_Row = tuple[str, int, str, str, float, bytes]


def _table(rows: Sequence[_Row]) -> Any:
    """The rows as one Arrow table of `schema()`; token arrays become list columns, no copy per value."""
    pa = _pyarrow()
    target = schema()
    columns: dict[str, list[Any]] = {name: [] for name in target.names}
    dumps = orjson.dumps
    for row in rows:
        sample = orjson.loads(row[5])
        meta = sample.get("metadata") or {}
        stop = meta.get("stop_reason")
        spans = sample.get("spans")
        held = sample.get("tokens") or {}
        values = (
            *row[:4],
            int(row[4] * 1_000_000),
            dumps(sample.get("messages", [])).decode(),
            dumps(meta).decode(),
            _number(meta.get("reward")),
            _number(meta.get("advantage")),
            int64_or_none(meta.get("policy_version", meta.get("policy_version_max"))),
            stop if isinstance(stop, str) else None,
            _number(sample.get("score")),
            dumps(spans).decode() if spans is not None else None,
            *(token_bytes(n, held[n]) if held.get(n) is not None else None for n in TOKEN_FIELDS),
        )
        for column, value in zip(columns.values(), values, strict=True):
            column.append(value)
    arrays = [
        _list_column(pa, TOKEN_FIELDS[f.name], columns[f.name])
        if f.name in TOKEN_FIELDS
        else pa.array(columns[f.name], f.type)
        for f in target
    ]
    return pa.Table.from_arrays(arrays, schema=target)


def _list_column(pa: Any, dtype: str, values: list[bytes | None]) -> Any:
    """A list column from each row's little-endian bytes: one buffer, offsets, and nulls where absent."""
    item = getattr(pa, _ARROW_TYPES[dtype])()
    width = item.bit_width // 8
    offsets = [0]
    for raw in values:
        offsets.append(offsets[-1] + (len(raw) // width if raw is not None else 0))
    data = pa.py_buffer(b"".join(raw for raw in values if raw is not None))
    flat = pa.Array.from_buffers(item, offsets[-1], [None, data])
    mask = pa.array([raw is None for raw in values], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, mask=mask)


def _read_journal(path: Path) -> list[_Row]:
    """The complete lines of a journal (a kill may have cut its last one short)."""
    rows: list[_Row] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError:
                break
            fields = (data["id"], data["step"], data["split"], data["key"], data["timestamp"])
            rows.append((*fields, orjson.dumps(data["sample"])))
    return rows


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    `max_records` records or `max_bytes` bytes of encoded samples (see docs/sinks.md).
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
    ) -> None:
        _pyarrow()
        check_int("max_records", max_records)
        check_int("max_bytes", max_bytes)
        check_int("compression_level", compression_level, allow_none=True)
        check_bool("fsync", fsync)
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
        self.stem = stem
        self.paths: list[Path] = []
        self.duplicates_skipped = 0
        self.recovered = 0
        self._pending: list[_Row] = []
        self._pending_bytes = 0
        self._journal: int | None = None  # the journal's descriptor, opened for appending
        self._next_index = 0
        self._known: set[str] | None = None
        # Given up on while the sink closed: the journal keeps any rows a failed last roll could
        # not write (the next sink recovers them), so any error of that release is dropped.
        self._guarded = Guard("ParquetSink", self._close_journal, Exception)
        self._backlog = Backlog("ParquetSink")

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

    def _write_file(self, stem: str, index: int, rows: Sequence[_Row]) -> Path:
        """One complete file: written under a temporary name, synced, renamed, the directory synced."""
        pq = _pyarrow().parquet
        final = self.directory / f"{stem}-{index:05d}{_SUFFIX}"
        temporary = self.directory / f".{final.name}.tmp"
        try:
            with open(temporary, "wb") as f:
                pq.write_table(_table(rows), f, compression="zstd", compression_level=self.compression_level)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _fsync_dir(self.directory)
        return final

    def _ids_in(self, paths: Iterable[Path], prefixes: set[str] | None = None) -> set[str]:
        pa = _pyarrow()
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
                existing = self._existing(stem)
                # A kill between a file's rename and the journal's reset leaves rows in both.
                stored = self._ids_in(existing)
                rows = [r for r in _read_journal(journal) if r[0] not in stored]
                if rows:
                    index = max((int(p.name[len(stem) + 1 : -len(_SUFFIX)]) for p in existing), default=-1)
                    self._write_file(stem, index + 1, rows)
                    self.recovered += len(rows)
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
            existing = self._existing(self.stem)
            if existing:
                self._next_index = int(existing[-1].name[len(self.stem) + 1 : -len(_SUFFIX)]) + 1
            path = self.directory / f".{self.stem}{_JOURNAL}"
            # Unbuffered: a failed append leaves nothing in a buffer to be written later, and
            # cutting the file back undoes it.
            journal = os.open(
                path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644
            )
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise PermanentSinkError(
                            f"ParquetSink: another sink writes with stem {self.stem!r} in {self.directory}"
                        ) from None
                if os.lseek(journal, 0, os.SEEK_END):
                    # This stem's own journal from a killed run (a fixed stem): its rows come first.
                    stored = self._ids_in(existing)
                    self._pending = [r for r in _read_journal(path) if r[0] not in stored]
                    self._pending_bytes = sum(len(r[5]) for r in self._pending)
            except BaseException:
                os.close(journal)
                raise
            self._journal = journal
        except OSError as exc:
            raise _permanent(exc, self.directory) or exc from exc

    def _roll(self) -> None:
        rows, self._pending, self._pending_bytes = self._pending, [], 0
        assert self.stem is not None
        try:
            path = self._write_file(self.stem, self._next_index, rows)
        except BaseException:
            self._pending = rows
            self._pending_bytes = sum(len(r[5]) for r in rows)
            raise
        self._next_index += 1
        self.paths.append(path)
        if self._journal is not None:
            # The rows are in the file now; a kill before this reset is undone by recovery's id check.
            os.ftruncate(self._journal, 0)

    def _write(self, records: Sequence[TraceRecord]) -> None:
        journal = self._journal
        if journal is None:
            raise RuntimeError("ParquetSink is not open")
        if any(r.replayed for r in records):
            records = self._unseen(records)
            if not records:
                return
        rows: list[_Row] = [(r.id, r.step, r.split, r.key, r.timestamp, r.payload) for r in records]
        start = os.lseek(journal, 0, os.SEEK_END)
        count, size = len(self._pending), self._pending_bytes
        try:
            _write_all(journal, b"".join(r.to_json() + b"\n" for r in records))
            if self.fsync:
                os.fsync(journal)
            self._pending.extend(rows)
            self._pending_bytes += sum(len(r[5]) for r in rows)
            if len(self._pending) >= self.max_records or self._pending_bytes >= self.max_bytes:
                self._roll()
        except BaseException as exc:
            # Nothing of this batch may stay behind: the retry writes it again.
            del self._pending[count:]
            self._pending_bytes = size
            with contextlib.suppress(OSError):
                os.ftruncate(journal, start)
            if isinstance(exc, OSError):
                raise _permanent(exc, self.directory) or exc from exc
            raise
        if self._known is not None:
            self._known.update(r[0] for r in rows)

    def _unseen(self, records: Sequence[TraceRecord]) -> list[TraceRecord]:
        """Replayed records that no file or journal here holds yet (a spool replays what a kill cut off)."""
        if self._known is None:
            prefixes = {r.id.rpartition("-")[0] for r in records if r.replayed}
            files = [p for p in self.directory.iterdir() if p.name.endswith(_SUFFIX) and p.name[0] != "."]
            self._known = self._ids_in(files, prefixes) | {r[0] for r in self._pending}
        known = self._known
        batch: set[str] = set()
        out = []
        for r in records:
            if not (r.replayed and (r.id in known or r.id in batch)):
                out.append(r)
                batch.add(r.id)
        self.duplicates_skipped += len(records) - len(out)
        return out

    def _close_journal(self) -> None:
        journal, self._journal = self._journal, None
        if journal is None:
            return
        try:
            if self._pending:
                self._roll()
            path = self.directory / f".{self.stem}{_JOURNAL}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            os.close(journal)

    # -- threads -----------------------------------------------------------------------------

    async def open(self) -> None:
        await run_sync_daemon(self._guarded, self._open_once, backlog=self._backlog)

    async def write(self, records: Sequence[TraceRecord]) -> None:
        await run_sync_daemon(self._guarded, self._write, records, backlog=self._backlog)

    async def close(self) -> None:
        await run_sync_daemon(self._guarded.close)
