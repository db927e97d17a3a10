"""ParquetSink's files: a journal's lines into one Parquet file, a row group at a time.

Used by the writer process (`_parquet_worker`), by the sink's file maker's thread with
``process=False``, and by recovery. What it holds is about one row group, whatever the file's size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Container, Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import IO, Any

import orjson

from ._parquet_rows import SAMPLE_KEY, RowBuffer, pyarrow

__all__ = ["CHUNK_BYTES", "ROW_GROUP_BYTES", "FileConverter", "file_ids", "journal_ids"]

# Encoded samples buffered before they become a row group: what bounds the memory a file costs.
ROW_GROUP_BYTES = 4 * 2**20
# Journal bytes read at a time (longer lines are read whole).
CHUNK_BYTES = 2 * 2**20
# Small columns whose values repeat; the large ones (text, token arrays) get neither a dictionary
# nor min/max statistics, which cost time and no reader uses.
_DICTIONARY = ["split", "key", "stop_reason"]
_STATISTICS = ["id", "step", "split", "key", "timestamp", "reward", "advantage", "policy_version", "score"]


def _chunks(fd: int, start: int, end: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The journal's bytes from `start` to `end` (both at line boundaries), whole lines at a time."""
    pos = start
    while pos < end:
        size = min(chunk_bytes, end - pos)
        chunk = os.pread(fd, size, pos)
        while True:
            if len(chunk) < size:
                raise OSError(f"the journal ended at {pos + len(chunk)} bytes, expected {end}")
            cut = chunk.rfind(b"\n") + 1
            if cut:
                break
            # One line longer than a chunk: read it whole.
            size = min(2 * size, end - pos)
            chunk = os.pread(fd, size, pos)
        yield chunk if cut == len(chunk) else chunk[:cut]
        pos += cut


def journal_ids(fd: int, start: int, end: int) -> set[str]:
    """The ids of the records in a journal's bytes from `start` to `end` (a damaged line has none)."""
    ids: set[str] = set()
    loads = orjson.loads
    for chunk in _chunks(fd, start, end):
        for line in chunk.splitlines():
            cut = line.find(SAMPLE_KEY)
            try:
                try:
                    head = loads(line[:cut] + b"}") if cut > 0 else loads(line)
                except orjson.JSONDecodeError:
                    head = loads(line)
            except orjson.JSONDecodeError:
                continue
            rid = head.get("id") if type(head) is dict else None
            if type(rid) is str:
                ids.add(rid)
    return ids


def file_ids(paths: Iterable[Path], prefixes: set[str] | None = None) -> set[str]:
    """The record ids the Parquet files at `paths` hold (only those starting with one of
    `prefixes` and a "-", where given); a file that is not one of ours (another schema, or not
    Parquet) holds none."""
    pa = pyarrow()
    import pyarrow.compute as pc

    ids: set[str] = set()
    for path in paths:
        try:
            column = pa.parquet.read_table(path, columns=["id"]).column("id")
        except (OSError, KeyError, pa.lib.ArrowException):
            continue
        keep = None
        for prefix in prefixes or ():
            hit = pc.starts_with(column, prefix + "-")
            keep = hit if keep is None else pc.or_(keep, hit)
        if keep is not None:
            column = column.filter(keep)
        ids.update(column.to_pylist())
    return ids


class FileConverter:
    """Turns a journal's lines into one Parquet file, a row group at a time.

    `start` gives it the file (open for writing) and the journal (open for reading); each
    `append(end)` converts the journal up to `end`, and `finish` closes the file, synced. The
    file is written and named by its owner: this class never creates or renames one.
    """

    def __init__(
        self,
        compression_level: int | None = None,
        row_group_bytes: int = ROW_GROUP_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.compression_level = compression_level
        self.row_group_bytes = row_group_bytes
        self.chunk_bytes = chunk_bytes
        self.rows = 0
        self.damaged = 0  # the last file's lines left out as damaged (see `RowBuffer.add`)
        self._buffer = RowBuffer()
        self._out: IO[bytes] | None = None
        self._journal: int | None = None
        self._writer: Any = None
        self._offset = 0
        self._end = 0
        self._skip: Container[str] = ()
        self._described: list[tuple[int, int, dict[str, Any]]] = []

    def start(self, out: int, journal: int, offset: int = 0) -> None:
        """Write to the file open at descriptor `out` the journal's lines from byte `offset` on
        (`journal`: open for reading); both descriptors are owned by the converter now."""
        self.reset()
        self._out = os.fdopen(out, "wb", buffering=2**20)
        self._journal = journal
        self._offset = self._end = offset
        self.rows = self.damaged = 0

    def append(
        self, end: int, skip: Container[str] = (), layout: dict[str, Any] | None = None, start: int = 0
    ) -> None:
        """Convert the journal's lines up to byte `end`, writing row groups as they fill; lines
        are read a chunk at a time (fewer, larger calls into pyarrow), the rest at `finish`.
        `layout`: how `journal_lines` wrote the lines from byte `start` on, if it did."""
        if self._journal is None:
            raise RuntimeError("FileConverter: append before start")
        if layout is not None and not skip and start >= self._end:
            self._described.append((start, end, layout))
        self._end = end
        self._skip = skip
        if end - self._offset >= self.chunk_bytes:
            self._convert()

    def _convert(self) -> None:
        assert self._journal is not None
        described = self._described
        while self._offset < self._end:
            if described and described[0][0] == self._offset:
                # Batches written by this sink: read together, up to a chunk, and cut by layout.
                stop, layouts = self._offset, list[dict[str, Any]]()
                while (
                    described
                    and described[0][0] == stop
                    and (not layouts or described[0][1] - self._offset <= self.chunk_bytes)
                ):
                    _, stop, layout = described.pop(0)
                    layouts.append(layout)
                merged = {k: list(chain.from_iterable(layout[k] for layout in layouts)) for k in layouts[0]}
                chunk = os.pread(self._journal, stop - self._offset, self._offset)
                if len(chunk) != stop - self._offset:
                    raise OSError(f"the journal ended at {self._offset + len(chunk)} bytes, expected {stop}")
                self._buffer.add_described(chunk, merged)
                self._offset = stop
            else:
                stop = described[0][0] if described else self._end
                for chunk in _chunks(self._journal, self._offset, stop, self.chunk_bytes):
                    self._buffer.add(chunk, self._skip)
                    self._offset += len(chunk)
            if self._buffer.nbytes >= self.row_group_bytes:
                self._flush()

    def _flush(self) -> None:
        if not self._buffer.rows:
            self._buffer.nbytes = 0
            return
        table = self._buffer.table()
        if self._writer is None:
            pq = pyarrow().parquet
            self._writer = pq.ParquetWriter(
                self._out,
                table.schema,
                compression="zstd",
                compression_level=self.compression_level,
                use_dictionary=_DICTIONARY,
                write_statistics=_STATISTICS,
            )
        self._writer.write_table(table, row_group_size=table.num_rows)
        self.rows += table.num_rows
        del table
        # What the row group took goes back to the system, not kept by pyarrow's allocator for
        # later: what the process holds stays about one row group.
        pyarrow().default_memory_pool().release_unused()

    def finish(self) -> int:
        """Write what is buffered and the file's footer, sync the file and close it; the row count
        (and in `damaged`, how many damaged lines were left out)."""
        out = self._out
        if out is None:
            raise RuntimeError("FileConverter: finish before start")
        self._convert()
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        out.flush()
        os.fsync(out.fileno())
        rows, damaged = self.rows, self._buffer.damaged
        self.reset()
        self.damaged = damaged
        return rows

    def reset(self) -> None:
        """Drop the file and what is buffered (its owner deletes the file)."""
        writer, self._writer = self._writer, None
        out, self._out = self._out, None
        journal, self._journal = self._journal, None
        self._buffer = RowBuffer()
        self._described = []
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()
        if journal is not None:
            with contextlib.suppress(OSError):
                os.close(journal)
