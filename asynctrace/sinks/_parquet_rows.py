"""ParquetSink's rows: journal lines in, Parquet row groups out, a bounded amount held at a time.

A journal line is ``{"id":...,"step":...,"split":...,"key":...,"timestamp":...,"sample":<payload>}``
with the payload as it was encoded at submission. Columns are built from the lines without a
Python object per JSON value of the conversation: the ``messages`` text is cut out of the payload
as it is (see `RowBuffer.add`), and only the metadata and what follows it are decoded. Used by
the writer process (`_parquet_worker`) and, in the sink's own thread, by recovery.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
from collections.abc import Container, Iterator, Sequence
from typing import IO, Any

import orjson

from .._checks import int64_or_none
from .._tokens import TOKEN_FIELDS, token_bytes

__all__ = [
    "CHUNK_BYTES",
    "ROW_GROUP_BYTES",
    "FileConverter",
    "RowBuffer",
    "journal_ids",
    "journal_lines",
    "pyarrow",
    "schema",
]

# Encoded samples buffered before they become a row group: what bounds the memory a file costs.
ROW_GROUP_BYTES = 8 * 2**20
# Journal bytes read at a time (longer lines are read whole).
CHUNK_BYTES = 4 * 2**20
_ARROW_TYPES = {"int32": "int32", "int8": "int8", "float32": "float32"}
# Small columns whose values repeat; the large ones (text, token arrays) get neither a dictionary
# nor min/max statistics, which cost time and no reader uses.
_DICTIONARY = ["split", "key", "stop_reason"]
_STATISTICS = ["id", "step", "split", "key", "timestamp", "reward", "advantage", "policy_version", "score"]
_SAMPLE = b',"sample":'
_MESSAGES = b'{"messages":['
_METADATA = b',"metadata":{'


def pyarrow() -> Any:
    """pyarrow with its Parquet module, or an ImportError naming the extra."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # loads pa.parquet
    except ImportError as exc:
        raise ImportError('ParquetSink needs pyarrow: pip install "asynctrace[parquet]"') from exc
    return pa


def schema() -> Any:
    """The one schema of every file a `ParquetSink` writes."""
    pa = pyarrow()
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


def journal_lines(records: Sequence[Any]) -> bytes:
    """The journal lines of `records` (`TraceRecord`s), one buffer; each payload copied as it is."""
    dumps = orjson.dumps
    parts: list[bytes] = []
    append = parts.append
    # Records of one call share step, split, key and timestamp: that part of the line is built
    # once per run of equal ones.
    last: tuple[int, str, str, float] | None = None
    tail = b""
    for r in records:
        fields = (r.step, r.split, r.key, r.timestamp)
        if fields != last:
            last = fields
            tail = b',"step":%d,"split":%b,"key":%b,"timestamp":%b,"sample":' % (
                r.step,
                dumps(r.split),
                dumps(r.key),
                dumps(r.timestamp),
            )
        append(b'{"id":' + dumps(r.id) + tail)
        append(r.payload)
        append(b"}\n")
    return b"".join(parts)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _string_column(pa: Any, pieces: list[Any]) -> Any:
    """A string column from each row's UTF-8 bytes: one join, offsets, checked in C++."""
    data = b"".join(pieces)
    if len(data) >= 2**31:
        return pa.array([bytes(p).decode() for p in pieces], pa.string())
    offsets = array.array("i", itertools.accumulate(map(len, pieces), initial=0))
    column = pa.StringArray.from_buffers(len(pieces), pa.py_buffer(offsets), pa.py_buffer(data))
    column.validate(full=True)  # a payload that is not UTF-8 fails here, not in a reader
    return column


def _list_column(pa: Any, dtype: str, values: list[bytes | None]) -> Any:
    """A list column from each row's little-endian bytes: one buffer, offsets, and nulls where absent."""
    item = getattr(pa, _ARROW_TYPES[dtype])()
    width = item.bit_width // 8
    offsets = array.array("i", itertools.accumulate((len(v) // width if v else 0 for v in values), initial=0))
    data = pa.py_buffer(b"".join(v for v in values if v))
    flat = pa.Array.from_buffers(item, offsets[-1], [None, data])
    mask = pa.array([v is None for v in values], pa.bool_())
    starts = pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)])
    return pa.ListArray.from_arrays(starts, flat, mask=mask)


class RowBuffer:
    """Journal lines parsed into columns, until `table()` hands them over as one Arrow table."""

    def __init__(self) -> None:
        self.rows = 0
        self.nbytes = 0
        self._ids: list[str] = []
        self._steps: list[int] = []
        self._splits: list[str] = []
        self._keys: list[str] = []
        self._times: list[int] = []
        self._messages: list[Any] = []  # bytes or memoryviews of the payloads
        self._metadata: list[bytes] = []
        self._rewards: list[float | None] = []
        self._advantages: list[float | None] = []
        self._versions: list[int | None] = []
        self._stops: list[str | None] = []
        self._scores: list[float | None] = []
        self._spans: list[str | None] = []
        self._tokens: dict[str, list[bytes | None]] = {name: [] for name in TOKEN_FIELDS}

    def add(self, chunk: bytes, skip: Container[str] = ()) -> None:
        """Take the lines of `chunk` (whole lines, each ending in a newline) but those whose id is skipped."""
        loads, dumps, decode_error = orjson.loads, orjson.dumps, orjson.JSONDecodeError
        view = memoryview(chunk)
        find, rfind, startswith = chunk.find, chunk.rfind, chunk.startswith
        ids, steps, splits, keys, times = self._ids, self._steps, self._splits, self._keys, self._times
        messages, metadata = self._messages.append, self._metadata.append
        rewards, advantages, versions = self._rewards.append, self._advantages.append, self._versions.append
        stops, scores, spans = self._stops.append, self._scores.append, self._spans.append
        tokens = self._tokens
        pos = 0
        end = len(chunk)
        while pos < end:
            newline = find(b"\n", pos)
            if newline < 0:
                raise ValueError("a journal chunk must end with a whole line")
            head: Any = None
            cut = find(_SAMPLE, pos, newline)
            # The first `,"sample":` of a line is its key: no JSON string holds `,"` unescaped.
            if cut > 0 and chunk[newline - 1] == 0x7D:  # "}"
                with contextlib.suppress(decode_error):
                    head = loads(chunk[pos:cut] + b"}")
            if type(head) is not dict or len(head) != 5:
                # Another layout of the same fields (an older journal): decoded whole.
                head = loads(view[pos:newline])
                sample = head["sample"]
                text: Any = dumps(sample.get("messages", []))
            else:
                start, stop = cut + 10, newline - 1
                sample = None
                if startswith(_MESSAGES, start):
                    # The metadata is the payload's second key, usually near its end.
                    cut = rfind(_METADATA, max(start, stop - 4096), stop)
                    if cut < 0:
                        cut = find(_METADATA, start, stop)
                    if cut > 0:
                        # Found where "messages" ends when what follows decodes as one object:
                        # text found inside the messages (or anywhere deeper) starts an object
                        # that closes before the payload does, and the closing brackets after
                        # it make that invalid. The messages' JSON is then taken as it was
                        # encoded, and only the rest is decoded.
                        with contextlib.suppress(decode_error):
                            sample = loads(b"{" + chunk[cut + 1 : stop])
                if type(sample) is dict and "messages" not in sample and type(sample["metadata"]) is dict:
                    text = view[start + 12 : cut]
                else:
                    sample = loads(view[start:stop])
                    text = dumps(sample.get("messages", []))
            rid = head["id"]
            pos = newline + 1
            if rid in skip:
                continue
            meta = sample.get("metadata") or {}
            if type(meta) is not dict:
                raise ValueError(f"record {rid!r}: metadata is a {type(meta).__name__}, not an object")
            ids.append(rid)
            steps.append(head["step"])
            splits.append(head["split"])
            keys.append(head["key"])
            times.append(int(head["timestamp"] * 1_000_000))
            messages(text)
            metadata(dumps(meta))
            value = meta.get("reward")
            rewards(float(value) if type(value) is float or type(value) is int else _number(value))
            value = meta.get("advantage")
            advantages(float(value) if type(value) is float or type(value) is int else _number(value))
            value = meta["policy_version"] if "policy_version" in meta else meta.get("policy_version_max")
            versions(value if type(value) is int and -(2**63) <= value < 2**63 else int64_or_none(value))
            value = meta.get("stop_reason")
            stops(value if type(value) is str else None)
            value = sample.get("score")
            scores(None if value is None else _number(value))
            value = sample.get("spans")
            spans(None if value is None else dumps(value).decode())
            held = sample.get("tokens")
            for name, column in tokens.items():
                value = held.get(name) if held else None
                column.append(None if value is None else token_bytes(name, value))
            self.rows += 1
        self.nbytes += end

    def table(self) -> Any:
        """The rows held as one table of `schema()`; the buffer is empty after."""
        pa = pyarrow()
        target = schema()
        floats, ints, strings = pa.float64(), pa.int64(), pa.string()
        columns = {
            "id": pa.array(self._ids, strings),
            "step": pa.array(self._steps, ints),
            "split": pa.array(self._splits, strings),
            "key": pa.array(self._keys, strings),
            "timestamp": pa.array(self._times, ints).cast(target.field("timestamp").type),
            "messages": _string_column(pa, self._messages),
            "metadata": _string_column(pa, self._metadata),
            "reward": pa.array(self._rewards, floats),
            "advantage": pa.array(self._advantages, floats),
            "policy_version": pa.array(self._versions, ints),
            "stop_reason": pa.array(self._stops, strings),
            "score": pa.array(self._scores, floats),
            "spans": pa.array(self._spans, strings),
        }
        for name, dtype in TOKEN_FIELDS.items():
            columns[name] = _list_column(pa, dtype, self._tokens[name])
        table = pa.Table.from_arrays([columns[name] for name in target.names], schema=target)
        self.__init__()  # type: ignore[misc]
        return table


def _chunks(fd: int, start: int, end: int) -> Iterator[bytes]:
    """The journal's bytes from `start` to `end` (both at line boundaries), whole lines at a time."""
    pos = start
    while pos < end:
        size = min(CHUNK_BYTES, end - pos)
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
    """The ids of the records in a journal's bytes from `start` to `end`."""
    ids: set[str] = set()
    loads = orjson.loads
    for chunk in _chunks(fd, start, end):
        for line in chunk.splitlines():
            cut = line.find(_SAMPLE)
            try:
                head = loads(line[:cut] + b"}") if cut > 0 else loads(line)
            except orjson.JSONDecodeError:
                head = loads(line)
            ids.add(head["id"])
    return ids


class FileConverter:
    """Turns a journal's lines into one Parquet file, a row group at a time.

    `start` gives it the file (open for writing) and the journal (open for reading); each
    `append(end)` converts the journal up to `end`, and `finish` closes the file, synced. The
    file is written and named by its owner: this class never creates or renames one.
    """

    def __init__(self, compression_level: int | None = None, row_group_bytes: int = ROW_GROUP_BYTES) -> None:
        self.compression_level = compression_level
        self.row_group_bytes = row_group_bytes
        self.rows = 0
        self._buffer = RowBuffer()
        self._out: IO[bytes] | None = None
        self._journal: int | None = None
        self._writer: Any = None
        self._offset = 0

    def start(self, out: int, journal: int, offset: int = 0) -> None:
        """Write to the file open at descriptor `out` the journal's lines from byte `offset` on
        (`journal`: open for reading); both descriptors are owned by the converter now."""
        self.reset()
        self._out = os.fdopen(out, "wb", buffering=2**20)
        self._journal = journal
        self._offset = offset
        self.rows = 0

    def append(self, end: int, skip: Container[str] = ()) -> None:
        """Convert the journal's lines up to byte `end`, writing row groups as they fill."""
        if self._journal is None:
            raise RuntimeError("FileConverter: append before start")
        for chunk in _chunks(self._journal, self._offset, end):
            self._buffer.add(chunk, skip)
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

    def finish(self) -> int:
        """Write what is buffered and the file's footer, sync the file and close it; the row count."""
        self._flush()
        out = self._out
        if out is None:
            raise RuntimeError("FileConverter: finish before start")
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        out.flush()
        os.fsync(out.fileno())
        rows = self.rows
        self.reset()
        return rows

    def reset(self) -> None:
        """Drop the file and what is buffered (its owner deletes the file)."""
        writer, self._writer = self._writer, None
        out, self._out = self._out, None
        journal, self._journal = self._journal, None
        self._buffer = RowBuffer()
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()
        if journal is not None:
            with contextlib.suppress(OSError):
                os.close(journal)
